"""The CUDA launches of the `torch.ops.kvbuffer.*` ops and the engine's calls of them, by the names the
engine, the runtime and the integrations use: each lives in its kernel family's module (kvbuffer.kernels.
conv, .attention, .gemv, .fp8_ops, .gdn, .mamba2, .prefill), which registers it (kvbuffer.kernels.specs).

A launch takes the custom op's arguments plus `checked`: True runs the family's validating launcher
first; False launches directly, skipping the checks that read the device back (slot ranges, duplicate
slots, buffer room, the fill rules), which stall the launch queue. Callers that built the slots and
lengths themselves (the engine's kernel Backend) pass False; shapes, dtypes and contiguity are still
checked by the compiled kernels' entry. A launch during CUDA-graph capture is always direct.
"""

from __future__ import annotations

from . import specs
from .attention import ATTENTION_DECODE, attention_key  # noqa: F401  (the names the engine uses)
from .attention import launch_decode as attention_decode  # noqa: F401
from .calls import EngineOp, capturing, engine_rows, on_torch_stream, token_axis  # noqa: F401
from .conv import CONV_ACCEPT, CONV_UPDATE  # noqa: F401
from .conv import accept_key as conv_accept_key  # noqa: F401
from .conv import launch_accept as conv1d_accept  # noqa: F401
from .conv import launch_update as conv1d_update  # noqa: F401
from .conv import update_key as conv_update_key  # noqa: F401
from .fp8_ops import FP8_GEMV_OP as FP8_GEMV  # noqa: F401
from .fp8_ops import FP8_QUANT_ACT_OP as FP8_QUANT_ACT  # noqa: F401
from .fp8_ops import fp8_gemv_key  # noqa: F401
from .fp8_ops import launch_fp8_gemv as fp8_gemv  # noqa: F401
from .gdn import GDN_OPS  # noqa: F401
from .gemv import GEMV_EXPERTS_OP as GEMV_EXPERTS  # noqa: F401
from .gemv import GEMV_OP as GEMV  # noqa: F401
from .gemv import GROUPED_EXPERTS_OP as GROUPED_EXPERTS  # noqa: F401
from .gemv import gemv_experts_key, gemv_key, grouped_experts_key  # noqa: F401
from .gemv import launch_gemv as gemv  # noqa: F401
from .gemv import launch_gemv_experts as gemv_experts  # noqa: F401
from .gemv import launch_grouped_experts as grouped_experts  # noqa: F401
from .linear import LinearOps  # noqa: F401
from .mamba2 import MAMBA2_OPS  # noqa: F401
from .prefill import chunk_prefill_key  # noqa: F401

CUDA_LAUNCHES = specs.CUDA_LAUNCHES  # op name -> the CUDA implementation of torch.ops.kvbuffer.<name>
