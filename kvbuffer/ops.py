"""`import kvbuffer.ops`: the documented entry point for the `torch.ops.kvbuffer.*` custom ops.

Importing it registers the ops (kvbuffer.kernels.torch_ops, where they and their docs live) and
gives users the switch for JIT compiles (`allow_jit`). Kept as a short public name for
integrations and the docs; the engine itself goes through kvbuffer.runtime.backend.
"""

from .kernels import OPS, allow_jit, clear_kernels, jit_allowed

__all__ = ["OPS", "allow_jit", "clear_kernels", "jit_allowed"]
