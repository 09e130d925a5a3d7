"""Outside oracles for kvbuffer's reference: transformers' torch fallbacks and FLA 0.6.0's naive functions.

Nothing here is kvbuffer code: every oracle is a function somebody else wrote, used as is (`fp32`
variants) or mechanically promoted to float64 (`fp64` variants, see `promote_fp64`).

Import order. transformers picks FLA / mamba_ssm / causal_conv1d kernels at *import* time of its
modeling modules when those packages import, so we block them (`sys.modules[name] = None`,
NOTES.md) around that import. While blocked, `importlib.util.find_spec("fla")` returns None (it
consults sys.modules first), so FLA's naive file is located with `importlib.machinery.PathFinder`,
which searches sys.path and ignores sys.modules: this works whichever test module pytest imports
first, and whether or not someone already imported transformers or blocked FLA. As a second guard, the oracles
are taken through `_raw`, i.e. the raw torch functions below transformers' kernel dispatch
wrappers (functools wrappers and the `kernels` package's function modules), so even an earlier unblocked import of transformers cannot route them to a
compiled kernel.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import torch

_FAST_PATHS = ("fla", "mamba_ssm", "causal_conv1d")
# Block the fast paths only while transformers' modeling modules import (that is when they bind
# their kernels), then unblock, so that other tests in the same process can still import FLA.
_blocked = [name for name in _FAST_PATHS if name not in sys.modules]  # keep a real module already imported
for _name in _blocked:
    sys.modules[_name] = None
try:
    from transformers.models.nemotron_h import modeling_nemotron_h as _nemotron_h
    from transformers.models.qwen3_5 import modeling_qwen3_5 as _qwen3_5
    from transformers.models.qwen3_next import modeling_qwen3_next as _qwen3_next
finally:
    for _name in _blocked:
        if sys.modules.get(_name, 0) is None:
            del sys.modules[_name]


def _raw(fn):
    """The torch function below transformers' dispatch: past functools wrappers, and past the module
    the `kernels` package (a dependency of recent transformers) makes of a decorated function, whose
    forward calls that function through its closure cell `func`."""
    forward = getattr(type(fn), "forward", None)
    if forward is not None and forward.__closure__:
        cells = dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__)))
        if "func" not in cells:
            raise TypeError(f"{fn!r}: a module without a wrapped function ('func') in its forward's closure")
        fn = cells["func"]
    raw = inspect.unwrap(fn)
    assert "transformers" in raw.__code__.co_filename or "fla" in raw.__code__.co_filename, raw
    return raw


# ----------------------------------------------------------------------------------------------
# float64 promotion of an oracle


class _Fp64Torch:
    """`torch` as seen by a promoted oracle: identical, except that float32 / float name float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


class _FloatToDouble(ast.NodeTransformer):
    """Rewrite `x.float()` (no arguments) into `x.double()`; count the rewrites."""

    def __init__(self):
        self.count = 0

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "float" and not node.args and not node.keywords:
            f.attr = "double"
            self.count += 1
        return node


def promote_fp64(fn):
    """The same oracle source, run in float64.

    The oracles hard-code fp32 (`.to(torch.float32)`, `.float()`, `dtype=torch.float`), which would
    bound any comparison at ~1e-7. We recompile the function's own source (decorators dropped, so
    no kernel dispatch), with `x.float()` rewritten to `x.double()` and module global `torch`
    replaced by a proxy whose float32 / float are float64. Nothing else of the algorithm changes,
    and the unmodified fp32 function is tested too (`*_fp32` comparisons).
    """
    raw = _raw(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    fdef = tree.body[0]
    assert isinstance(fdef, ast.FunctionDef) and fdef.name == raw.__name__
    fdef.decorator_list = []
    tree = ast.fix_missing_locations(_FloatToDouble().visit(tree))
    ns = dict(raw.__globals__)
    ns["torch"] = _Fp64Torch()
    exec(compile(tree, f"<fp64 copy of {raw.__module__}.{raw.__name__}>", "exec"), ns)
    return ns[raw.__name__]


# ----------------------------------------------------------------------------------------------
# transformers


class HF:
    """transformers' torch fallbacks, raw (fp32 as shipped) and promoted to fp64."""

    gdn_recurrent_fp32 = staticmethod(_raw(_qwen3_5.torch_recurrent_gated_delta_rule))
    gdn_chunk_fp32 = staticmethod(_raw(_qwen3_5.torch_chunk_gated_delta_rule))
    gdn_recurrent_fp64 = staticmethod(promote_fp64(_qwen3_5.torch_recurrent_gated_delta_rule))
    gdn_chunk_fp64 = staticmethod(promote_fp64(_qwen3_5.torch_chunk_gated_delta_rule))
    # Qwen3-Next ships its own copies; the tests check they agree with Qwen3.5's
    next_gdn_recurrent_fp64 = staticmethod(promote_fp64(_qwen3_next.torch_recurrent_gated_delta_rule))
    next_gdn_chunk_fp64 = staticmethod(promote_fp64(_qwen3_next.torch_chunk_gated_delta_rule))

    mamba2_update_fp32 = staticmethod(_raw(_nemotron_h.mamba2_selective_state_update))
    mamba2_scan_fp32 = staticmethod(_raw(_nemotron_h.mamba2_chunk_scan))
    mamba2_update_fp64 = staticmethod(promote_fp64(_nemotron_h.mamba2_selective_state_update))
    mamba2_scan_fp64 = staticmethod(promote_fp64(_nemotron_h.mamba2_chunk_scan))

    # dtype-agnostic already (they compute in the weight's dtype)
    conv_update = staticmethod(_raw(_qwen3_5.causal_conv1d_update))
    conv_fn = staticmethod(_raw(_qwen3_5.causal_conv1d_fn))
    nemotron_conv_update = staticmethod(_raw(_nemotron_h.causal_conv1d_update))


# ----------------------------------------------------------------------------------------------
# FLA 0.6.0 naive functions


@lru_cache(maxsize=None)
def fla_naive():
    """FLA's `fla/ops/gated_delta_rule/naive.py` as a standalone module, or None if fla-core is absent.

    Loaded by file path under a top-level name outside the `fla` package, so `fla/__init__.py`
    (which imports fla.layers / fla.ops, hence triton) never runs. The file itself imports only
    torch, torch.nn.functional and einops.rearrange, so nothing has to be stubbed; without einops
    (fla-core's one dependency) we report FLA as unavailable rather than stub it.
    """
    spec = importlib.machinery.PathFinder.find_spec("fla")  # not importlib.util.find_spec: see module doc
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if importlib.util.find_spec("einops") is None:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "gated_delta_rule" / "naive.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_oracle_fla_gated_delta_rule_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    mod.FLA_VERSION = version
    mod.recurrent_fp32 = mod.naive_recurrent_gated_delta_rule  # (q, k, v, beta, g, ...)
    mod.chunk_fp32 = mod.naive_chunk_gated_delta_rule  # (q, k, v, g, beta, chunk_size, ...)
    mod.recurrent_fp64 = promote_fp64(mod.naive_recurrent_gated_delta_rule)
    mod.chunk_fp64 = promote_fp64(mod.naive_chunk_gated_delta_rule)
    return mod
