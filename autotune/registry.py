"""The templates the tuner knows: one `Template` per kernel, built from kvbuffer.tiles.

A Template is all the tuner needs and nothing TileLang-specific beyond `build`:
    build(shape, chunk_size, **tunables) -> a compiled TileLang kernel (JITKernel, out_idx=None ABI)
    configs() -> the tunables worth trying; defaults -> the ones used when nothing is measured
    make_inputs(shape, batch, chunk_size, device, gen) -> every argument of the kernel, in order
    reference(shape, chunk_size, args) -> {argument index: expected value after the kernel ran}
    run(kernel, args) -> launch once (what the timer measures)
`shape` is a plain dict: family ('gdn' or 'mamba2'), Hk, Hv, K, V and dtype (activations and
buffer entries); see kvbuffer.pools.LinearLayerShape for the Mamba-2 mapping onto Hk/Hv/K/V.
Templates whose kernel depends on the buffer layout (`layouts=True`) also take `drafts=T` in build
and make_inputs: buffers of C + T + 1 entries, the engine's layout for T speculative drafts (T = 0:
plain decoding, C + 1 entries); `min_drafts=1` marks kernels only speculative decoding needs.

Registered now, per layout: the decode kernels of tiles/gdn.py and tiles/mamba2.py (buffered step
with the flush fused at C, stand-alone flush), the prefill chunks the engine cuts prompts into
(T = 8, 4, 2 tokens, flush fused at C) and the verify of T drafts plus the last token; the
recurrent step once. The short conv's kernels are in kvbuffer.autotune.conv_templates (family
"conv1d"), decode attention's in kvbuffer.autotune.attention_templates (family "attention"), the
projections' in kvbuffer.autotune.gemv_templates (families "gemv", "experts" and "grouped").
TileLang and torch are imported only inside the callables.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from kvbuffer.kernels.keys import PREFILL_CHUNKS  # the engine's prompt chunks: tune builds exactly these

GDN_TILES = "kvbuffer.tiles.gdn"
MAMBA2_TILES = "kvbuffer.tiles.mamba2"


@dataclass(frozen=True)
class Template:
    name: str
    family: str
    build: Callable[..., Any] = field(repr=False)
    configs: Callable[[], list] = field(repr=False)
    defaults: Mapping[str, Any]
    make_inputs: Callable[..., list] = field(repr=False)
    reference: Callable[..., dict] = field(repr=False)
    run: Callable[..., None] = field(repr=False)
    source: str = ""          # sha256 of the template's source file: part of the artifact key
    uses_chunk: bool = True   # False: one kernel serves every chunk size (stored with chunk_size 0)
    tolerance: float = 2e-2   # relative error (vs the fp32 reference) a variant may have
    min_chunk: int = 1        # smallest chunk size the kernel makes sense for (a T-token chunk needs C >= T)
    fitted: Callable[[Mapping, int], Mapping] | None = field(default=None, repr=False)  # (shape, drafts) -> defaults
    layouts: bool = False     # build / make_inputs take drafts=T (buffers of C + T + 1 entries)
    min_drafts: int = 0       # 1: only speculative decoding launches it (the verify)

    def defaults_for(self, shape: Mapping, drafts: int = 0) -> dict:
        """The untuned tunables for one head shape and buffer layout: `fitted(shape, drafts)` where the
        template narrows its measured best to the head dims (and the tokens per row), else the fixed
        `defaults`."""
        return dict(self.fitted(shape, drafts) if self.fitted else self.defaults)

    def drafts_for(self, draft_tokens) -> list[int]:
        """The buffer layouts (draft counts) to build this kernel for: 0 alone unless it depends on them."""
        if not self.layouts:
            return [0]
        return [d for d in sorted(set(draft_tokens)) if d >= self.min_drafts]

    def compile(self, shape: Mapping, chunk_size: int, drafts: int, *, target, **tunables):
        return self.build(dict(shape), chunk_size, target=target, **self._layout(drafts), **tunables)

    def inputs(self, shape: Mapping, batch: int, chunk_size: int, device, gen, drafts: int = 0) -> list:
        return self.make_inputs(dict(shape), batch, chunk_size, device, gen, **self._layout(drafts))

    def _layout(self, drafts: int) -> dict:
        if drafts and not self.layouts:
            raise ValueError(f"{self.name} does not depend on the buffer layout; build it with drafts=0")
        return {"drafts": drafts} if self.layouts else {}


def capacity(chunk_size: int, drafts: int = 0) -> int:
    """Buffer entries per slot in the engine's layout: C to fold, T drafts past them, one more token."""
    return chunk_size + drafts + 1


TEMPLATE_IMPORTS = ("kvbuffer.reference.core", "kvbuffer.kernels.keys")  # runtime modules the templates use


def source_digest(package: str = "kvbuffer.tiles", imports: tuple[str, ...] = TEMPLATE_IMPORTS) -> str:
    """sha256 over every .py file of the templates' package (templates share code across files) and
    the runtime modules they import (a decay floor, the attention kernel's query-block rule): an
    edit to any of them gives new artifacts."""
    spec = importlib.util.find_spec(package)
    paths = sorted(Path(spec.origin).parent.glob("*.py")) + [Path(importlib.util.find_spec(m).origin) for m in imports]
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def builder_defaults(fn: Callable, names) -> dict:
    """The defaults a template function declares for the given tunables."""
    params = inspect.signature(fn).parameters
    return {n: params[n].default for n in names}


# ----------------------------------------------------------------------------------------------
# Gated DeltaNet (tiles/gdn.py)


def _gdn():
    return importlib.import_module(GDN_TILES)


def _compile(prim_func, target: dict):
    return importlib.import_module("kvbuffer.tiles").compile_template(prim_func, target)


def _gdn_dims(shape: Mapping) -> dict:
    return {k: shape[k] for k in ("Hk", "Hv", "K", "V")}


def _gdn_tokens(shape, batch, gen, device, T=1):
    import torch

    dt = getattr(torch, shape["dtype"])
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k, v = r(batch, T, Hk, K).to(dt), r(batch, T, Hk, K).to(dt), r(batch, T, Hv, V).to(dt)
    a, b = r(batch, T, Hv).to(dt), r(batch, T, Hv).to(dt)
    A_log = torch.log(1.0 + 15.0 * torch.rand(Hv, generator=gen, device=device))
    dt_bias = torch.log(torch.expm1(0.001 + 0.099 * torch.rand(Hv, generator=gen, device=device)))
    return q, k, v, a, b, A_log, dt_bias


def _gdn_pools(shape, batch, cap, gen, device, lo, hi):
    """State and buffer pools; row b's buffer holds lengths[b] in [lo, hi) entries (steady state)."""
    import torch

    dt = getattr(torch, shape["dtype"])
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    state = 0.5 * torch.randn(batch, Hv, K, V, generator=gen, device=device)
    kk = torch.nn.functional.normalize(torch.randn(batch, cap, Hk, K, generator=gen, device=device), dim=-1)
    buf_v = (0.5 * torch.randn(batch, cap, Hv, V, generator=gen, device=device)).to(dt)
    buf_g = torch.cumsum(-(0.02 + 0.5 * torch.rand(batch, cap, Hv, generator=gen, device=device)), dim=1)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    lengths = torch.randint(lo, hi, (batch,), generator=gen, device=device, dtype=torch.int32)
    return state, slots, kk.to(dt), buf_v, buf_g, slots.clone(), lengths


def _gdn_recurrent_inputs(shape, batch, chunk_size, device, gen):
    import torch

    q, k, v, a, b, A_log, dt_bias = _gdn_tokens(shape, batch, gen, device)
    state = 0.5 * torch.randn(batch, shape["Hv"], shape["K"], shape["V"], generator=gen, device=device)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    return [q, k, v, a, b, A_log, dt_bias, state, slots, torch.empty_like(v)]


def _gdn_recurrent_reference(shape, chunk_size, args):
    from kvbuffer.reference import gdn

    state = args[7].clone()
    o = gdn.recurrent_step(*(t[:, 0] for t in args[:5]), args[5], args[6], state, args[8])
    return {7: state, 9: o[:, None]}


def _buffered_inputs(tokens, offset: int, T: int | None):
    """make_inputs of a buffered kernel fed T tokens per row (None: a verify of drafts + 1 tokens).

    With a fused flush at C, rows hold n <= C - T entries, so some reach C and fold (steady state);
    a verify's rows hold n < C, and its T tokens land in the entries past them."""
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        import torch

        fed = T or drafts + 1
        hi = chunk_size if T is None else chunk_size - T + 1
        front = tokens(shape, batch, gen, device, fed)
        pools = _gdn_pools(shape, batch, capacity(chunk_size, drafts), gen, device, 0, hi)
        return [*front, *pools, torch.empty_like(front[offset])]
    return inputs


def _buffered_reference(ops_module: str, front, first_pool: int, flush: bool):
    """Expected results of a buffered kernel: the reference verify of its tokens; with `flush`, then
    the fold of the rows whose buffer reached C (decode step, prefill chunk); without, a speculative
    verify, whose new buffer entries are checked too."""
    def reference(shape, chunk_size, args):
        import torch

        ops = importlib.import_module(ops_module)
        state, bk, bv, bg = (args[i].clone() for i in (first_pool, first_pool + 2, first_pool + 3, first_pool + 4))
        sslots, bslots, lengths = args[first_pool + 1], args[first_pool + 5], args[first_pool + 6]
        T = args[0].shape[1]
        o = ops.verify(*front(args), state, sslots, bk, bv, bg, bslots, lengths)
        if not flush:
            return {first_pool: state, first_pool + 2: bk, first_pool + 3: bv, first_pool + 4: bg, first_pool + 7: o}
        full = torch.where((lengths + T == chunk_size) & (bslots >= 0), bslots, torch.full_like(bslots, -1))
        ops.flush(state, sslots, bk, bv, bg, full, lengths + T)
        return {first_pool: state, first_pool + 7: o}
    return reference


def _flush_inputs(shape, batch, chunk_size, device, gen, drafts=0):
    """Rows hold 1 .. C + T entries (after a verify, a buffer may pass C by the accepted drafts)."""
    cap = capacity(chunk_size, drafts)
    return list(_gdn_pools(shape, batch, cap, gen, device, 1, cap))


def _flush_reference(shape, chunk_size, args):
    from kvbuffer.reference import core

    state = args[0].clone()
    core.flush(state, *args[1:])
    return {0: state}


def _run(kernel, args) -> None:
    kernel(*args)


@dataclass(frozen=True)
class _Family:
    """What differs between the GDN and Mamba-2 layout-dependent templates."""

    name: str
    tiles: Any                  # the tiles module
    buffered: Callable          # tiles' buffered template (step / chunk / verify)
    flush: Callable             # tiles' flush template
    dims: Callable              # shape -> the template's head-dim keywords
    tokens: Callable            # (shape, batch, gen, device, T) -> the kernel's front arguments
    offset: int                 # the front argument the output is shaped like
    front: Callable             # args -> the reference verify's front arguments
    first_pool: int             # index of `state` in the kernel's arguments
    configs: Callable           # the buffered kernels' configs
    tunables: tuple             # the buffered kernels' tunable names
    recurrent: Callable         # tiles' recurrent step (the baseline), and its inputs and reference
    recurrent_inputs: Callable
    recurrent_reference: Callable
    recurrent_drafts: Callable  # tiles' recurrent verify of drafts + 1 fed tokens (the speculative baseline)

    @property
    def reference_module(self) -> str:
        return f"kvbuffer.reference.{self.name}"


def _family_templates(f: _Family) -> list[Template]:
    """Decode step and prefill chunks (flush fused at C), verify of T drafts, and the stand-alone
    flush, built per buffer layout (C + T + 1 entries); the recurrent step, built once."""
    src = source_digest()

    def buffered(T: int | None, fused: bool):
        def build(shape, chunk_size, *, target, drafts=0, **t):
            prim = f.buffered(**f.dims(shape), cap=capacity(chunk_size, drafts), T_new=T or drafts + 1,
                              flush_at=chunk_size if fused else 0, in_dtype=shape["dtype"],
                              buf_dtype=shape["dtype"], **t)
            return _compile(prim, target)
        return build

    def flush(shape, chunk_size, *, target, drafts=0, **t):
        return _compile(f.flush(**f.dims(shape), cap=capacity(chunk_size, drafts), buf_dtype=shape["dtype"], **t),
                        target)

    defaults = builder_defaults(f.buffered, f.tunables)
    def fitted(T: int | None):  # the JIT's tunables for the same kernel (kvbuffer.kernels.lookup.jit_tunables)
        return lambda shape, drafts: f.tiles.default_buffered_tunables(shape["K"], shape["V"], T or drafts + 1,
                                                                        shape["Hv"] // shape["Hk"])
    folding = _buffered_reference(f.reference_module, f.front, f.first_pool, flush=True)

    def variant(name, T, fused, reference, **extra):
        return Template(f"{f.name}_{name}", f.name, buffered(T, fused), _offered(f.configs, T), defaults,
                        _buffered_inputs(f.tokens, f.offset, T), reference, _run, src, fitted=fitted(T),
                        layouts=True, **extra)

    def recurrent(shape, chunk_size, *, target, **t):
        return _compile(f.recurrent(**f.dims(shape), in_dtype=shape["dtype"], **t), target)

    def recurrent_drafts(shape, chunk_size, *, target, drafts=0, **t):
        return _compile(f.recurrent_drafts(**f.dims(shape), T_new=drafts + 1, in_dtype=shape["dtype"], **t), target)

    flush_defaults = builder_defaults(f.flush, ("BV", "threads"))
    recurrent_defaults = builder_defaults(f.recurrent, ("BV", "threads"))
    chunks = [variant(f"prefill_chunk{T}", T, True, folding, min_chunk=T) for T in PREFILL_CHUNKS]
    return chunks + [
        variant("buffered_step", 1, True, folding),
        variant("verify", None, False, _buffered_reference(f.reference_module, f.front, f.first_pool, flush=False),
             min_drafts=1),
        Template(f"{f.name}_flush", f.name, flush, f.tiles.get_flush_configs, flush_defaults, _flush_inputs,
                 _flush_reference, _run, src, layouts=True, fitted=_value_tile_fitted(flush_defaults)),
        Template(f"{f.name}_recurrent", f.name, recurrent, f.tiles.get_recurrent_configs, recurrent_defaults,
                 f.recurrent_inputs, f.recurrent_reference, _run, src, uses_chunk=False,
                 fitted=_value_tile_fitted(recurrent_defaults)),
        # the recurrent step's tiles (one its front cannot lay out for some T fails to build, and the tuner
        # skips it as any config that does not compile)
        Template(f"{f.name}_recurrent_drafts", f.name, recurrent_drafts, f.tiles.get_recurrent_configs,
                 recurrent_defaults, _drafts_inputs(f), _drafts_reference(f), _run, src, uses_chunk=False, layouts=True,
                 min_drafts=1, fitted=_drafts_fitted(f.name)),
    ]


def _drafts_fitted(family: str) -> Callable[[Mapping, int], dict]:
    """The JIT's tunables for a recurrent verify of drafts + 1 tokens (kvbuffer.kernels.lookup)."""
    def fitted(shape, drafts):
        from kvbuffer.kernels.lookup import untuned_tunables

        return untuned_tunables(family, "recurrent_drafts", shape["K"], shape["V"], drafts + 1)
    return fitted


def _drafts_inputs(f: "_Family") -> Callable[..., list]:
    """The recurrent verify's arguments: the front of drafts + 1 tokens, the state pool and its slots, a
    pool of per-token states and each row's place in it, the output."""
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        import torch

        fed = drafts + 1
        front = f.tokens(shape, batch, gen, device, fed)
        Hv, K, V = shape["Hv"], shape["K"], shape["V"]
        state = 0.5 * torch.randn(batch, Hv, K, V, generator=gen, device=device)
        slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
        rows = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
        pool = torch.zeros(batch, fed, Hv, K, V, device=device)
        return [*front, state, slots, pool, rows, torch.empty_like(front[f.offset])]
    return inputs


def _drafts_reference(f: "_Family") -> Callable[..., dict]:
    def reference(shape, chunk_size, args):
        ops = importlib.import_module(f.reference_module)
        p = f.first_pool
        pool = args[p + 2].clone()
        o = ops.recurrent_drafts(*f.front(args), args[p], args[p + 1], pool, args[p + 3])
        return {p + 2: pool, p + 4: o}
    return reference


def _offered(configs: Callable[[], list], T: int | None) -> Callable[[], list]:
    """The configs tuned for a kernel of T tokens (None: a verify): all of them, except that the decode
    step (T = 1) is not offered the tensor-core S0 products, which only pay for wide verifies (on the
    H200 the step ran 1.4x slower with them; docs/kernels.md), nor GDN's `lean`, which needs two tokens."""
    if T != 1:
        return configs
    return lambda: [c for c in configs() if not c.get("tensor_cores") and not c.get("lean")]


def _value_tile_fitted(defaults: Mapping) -> Callable[[Mapping, int], dict]:
    """Defaults whose value tile BV is narrowed to the head's V (a tiny model's V = 16 < BV = 32),
    as the JIT's tunables are (kvbuffer.kernels.lookup.jit_tunables); the same for every layout."""
    return lambda shape, drafts: {**defaults, "BV": min(defaults["BV"], shape["V"])}


def gdn_templates() -> list[Template]:
    g = _gdn()
    return _family_templates(_Family(
        "gdn", g, g.gdn_buffered, g.gdn_flush, _gdn_dims, _gdn_tokens, offset=2, front=lambda a: a[:7], first_pool=7,
        configs=g.get_buffered_configs, tunables=("BV", "threads"), recurrent=g.gdn_recurrent,
        recurrent_inputs=_gdn_recurrent_inputs, recurrent_reference=_gdn_recurrent_reference,
        recurrent_drafts=g.gdn_recurrent_drafts))


# ----------------------------------------------------------------------------------------------
# Mamba-2 (tiles/mamba2.py): G = Hk groups, H = Hv heads, N = K state size, P = V head dim; z not used.
# The buffered kernels try two templates with one ABI (tunable `variant`): get_buffered_configs
# interleaves the thread-level default (tiles/mamba2_simt.py, "simt") and the generic one ("reduce"),
# so `--max-configs 2` already times both and the tuner keeps whichever is faster per batch bucket.


def _m2_dims(shape: Mapping) -> dict:
    return {"G": shape["Hk"], "H": shape["Hv"], "N": shape["K"], "P": shape["V"]}


def _m2_tokens(shape, batch, gen, device, T=1):
    """x, dt, A_log, dt_bias, Bm, Cm, D, z (= x: kernels built without has_z ignore it)."""
    import torch

    dt_ = getattr(torch, shape["dtype"])
    G, H, N, P = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x, dt = r(batch, T, H, P).to(dt_), r(batch, T, H).to(dt_)
    A_log = torch.log(1.0 + 15.0 * torch.rand(H, generator=gen, device=device))
    dt_bias = torch.log(torch.expm1(0.001 + 0.099 * torch.rand(H, generator=gen, device=device)))
    Bm, Cm, D = r(batch, T, G, N).to(dt_), r(batch, T, G, N).to(dt_), r(H)
    return [x, dt, A_log, dt_bias, Bm, Cm, D, x]


def _m2_recurrent_inputs(shape, batch, chunk_size, device, gen):
    import torch

    front = _m2_tokens(shape, batch, gen, device)
    state = 0.5 * torch.randn(batch, shape["Hv"], shape["K"], shape["V"], generator=gen, device=device)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    return front + [state, slots, torch.empty_like(front[0])]


def _m2_recurrent_reference(shape, chunk_size, args):
    from kvbuffer.reference import mamba2

    state = args[8].clone()
    x, dt, A_log, dt_bias, Bm, Cm, D = args[:7]
    y = mamba2.recurrent_step(x[:, 0], dt[:, 0], A_log, dt_bias, Bm[:, 0], Cm[:, 0], D, state, args[9])
    return {8: state, 10: y[:, None]}


def mamba2_templates() -> list[Template]:
    m = importlib.import_module(MAMBA2_TILES)
    return _family_templates(_Family(
        "mamba2", m, m.mamba2_buffered, m.mamba2_flush, _m2_dims, _m2_tokens, offset=0, front=lambda a: a[:7],
        first_pool=8, configs=m.get_buffered_configs, tunables=("variant", "BV", "threads", "blocks", "heads"),
        recurrent=m.mamba2_recurrent, recurrent_inputs=_m2_recurrent_inputs,
        recurrent_reference=_m2_recurrent_reference, recurrent_drafts=m.mamba2_recurrent_drafts))


def templates(family: str | None = None) -> list[Template]:
    """Every registered template (optionally of one family: "gdn", "mamba2", "conv1d", "attention", "gemv",
    "experts" or "grouped")."""
    from .attention_templates import attention_templates
    from .conv_templates import conv_templates
    from .gemv_templates import gemv_templates

    found = gdn_templates()
    if importlib.util.find_spec(MAMBA2_TILES) is not None:
        found += mamba2_templates()
    found += conv_templates() + attention_templates() + gemv_templates()
    return [t for t in found if family in (None, t.family)]
