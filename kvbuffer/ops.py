"""`import kvbuffer.ops`: the documented entry point for the `torch.ops.kvbuffer.*` custom ops.

Importing it registers the ops (each kernel family's module of kvbuffer.kernels defines its own;
kvbuffer.kernels.torch_ops states their contract) and gives users the switch for JIT compiles
(`allow_jit`); `OPS` names every op. Kept as a short public name for
integrations and the docs; the engine itself goes through kvbuffer.runtime.backend.
"""

from .kernels import OPS, allow_jit, clear_kernels, jit_allowed

__all__ = ["OPS", "allow_jit", "clear_kernels", "jit_allowed"]
