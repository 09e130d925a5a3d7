"""The templates the tuner knows: one `Template` per kernel, built from kvbuffer.tiles.

A Template is all the tuner needs and nothing TileLang-specific beyond `build`:
    build(shape, chunk_size, **tunables) -> a compiled TileLang kernel (JITKernel, out_idx=None ABI)
    configs() -> the tunables worth trying; defaults -> the ones used when nothing is measured
    make_inputs(shape, batch, chunk_size, device, gen) -> every argument of the kernel, in order
    reference(shape, chunk_size, args) -> {argument index: expected value after the kernel ran}
    run(kernel, args) -> launch once (what the timer measures)
`shape` is a plain dict: family ('gdn' or 'mamba2'), Hk, Hv, K, V and dtype (activations and
buffer entries); see kvbuffer.pools.LinearLayerShape for the Mamba-2 mapping onto Hk/Hv/K/V.

Registered now: the decode kernels of tiles/gdn.py and tiles/mamba2.py (recurrent step, buffered
step with the flush fused at C, stand-alone flush) and the prefill chunks the engine cuts prompts
into (T = 8, 4, 2 tokens, flush fused at C), all for the engine's buffer layout of C + 1 entries.
Speculative verify (T drafts, no flush) is not built here yet. TileLang and torch are imported
only inside the callables.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

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
    fitted: Callable[[Mapping], Mapping] | None = field(default=None, repr=False)  # shape -> defaults

    def defaults_for(self, shape: Mapping) -> dict:
        """The untuned tunables for one head shape: `fitted(shape)` where the template narrows its
        measured best to the head dims, else the fixed `defaults`."""
        return dict(self.fitted(shape) if self.fitted else self.defaults)


def source_digest(package: str = "kvbuffer.tiles") -> str:
    """sha256 over every .py file of the templates' package (templates share code across files)."""
    spec = importlib.util.find_spec(package)
    h = hashlib.sha256()
    for path in sorted(Path(spec.origin).parent.glob("*.py")):
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


PREFILL_CHUNKS = (8, 4, 2)  # the engine's prefill cuts prompts into chunks of 8/4/2/1 tokens


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


def _gdn_buffered_inputs(shape, batch, chunk_size, device, gen):
    import torch

    q, k, v, a, b, A_log, dt_bias = _gdn_tokens(shape, batch, gen, device)
    pools = _gdn_pools(shape, batch, chunk_size + 1, gen, device, 0, chunk_size)
    return [q, k, v, a, b, A_log, dt_bias, *pools, torch.empty_like(v)]


def _gdn_buffered_reference(shape, chunk_size, args):
    from kvbuffer.reference import gdn

    state, bk, bv, bg = (args[i].clone() for i in (7, 9, 10, 11))
    o = gdn.buffered_step(*(t[:, 0] for t in args[:5]), args[5], args[6], state, args[8], bk, bv, bg,
                          args[12], args[13], flush_at=chunk_size)
    return {7: state, 14: o[:, None]}


def _chunk_inputs(tokens, offset):
    """make_inputs of a T-token prefill chunk: rows hold n <= C - T entries, so some reach C and flush."""
    def make(T):
        def inputs(shape, batch, chunk_size, device, gen):
            import torch

            front = tokens(shape, batch, gen, device, T)
            pools = _gdn_pools(shape, batch, chunk_size + 1, gen, device, 0, chunk_size - T + 1)
            return [*front, *pools, torch.empty_like(front[offset])]
        return inputs
    return make


def _chunk_reference(ops_module, front, first_pool):
    """Expected state and outputs of a prefill chunk: verify, then flush the rows that reached C."""
    def reference(shape, chunk_size, args):
        import torch

        ops = importlib.import_module(ops_module)
        state, bk, bv, bg = (args[i].clone() for i in (first_pool, first_pool + 2, first_pool + 3, first_pool + 4))
        sslots, bslots, lengths = args[first_pool + 1], args[first_pool + 5], args[first_pool + 6]
        T = args[0].shape[1]
        o = ops.verify(*front(args), state, sslots, bk, bv, bg, bslots, lengths)
        full = torch.where((lengths + T == chunk_size) & (bslots >= 0), bslots, torch.full_like(bslots, -1))
        ops.flush(state, sslots, bk, bv, bg, full, lengths + T)
        return {first_pool: state, first_pool + 7: o}
    return reference


def _gdn_flush_inputs(shape, batch, chunk_size, device, gen):
    return list(_gdn_pools(shape, batch, chunk_size + 1, gen, device, 1, chunk_size + 1))


def _gdn_flush_reference(shape, chunk_size, args):
    from kvbuffer.reference import gdn

    state = args[0].clone()
    gdn.flush(state, *args[1:])
    return {0: state}


def _run(kernel, args) -> None:
    kernel(*args)


def gdn_templates() -> list[Template]:
    g = _gdn()
    src = source_digest()
    tun = ("BV", "threads")

    def recurrent(shape, chunk_size, *, target, **t):
        return _compile(g.gdn_recurrent(**_gdn_dims(shape), in_dtype=shape["dtype"], **t), target)

    def buffered(shape, chunk_size, *, target, **t):
        prim = g.gdn_buffered(**_gdn_dims(shape), cap=chunk_size + 1, T_new=1, flush_at=chunk_size,
                              in_dtype=shape["dtype"], buf_dtype=shape["dtype"], **t)
        return _compile(prim, target)

    def flush(shape, chunk_size, *, target, **t):
        return _compile(g.gdn_flush(**_gdn_dims(shape), cap=chunk_size + 1, buf_dtype=shape["dtype"], **t), target)

    def chunk(T):
        def build(shape, chunk_size, *, target, **t):
            prim = g.gdn_buffered(**_gdn_dims(shape), cap=chunk_size + 1, T_new=T, flush_at=chunk_size,
                                  in_dtype=shape["dtype"], buf_dtype=shape["dtype"], **t)
            return _compile(prim, target)
        return build

    inputs = _chunk_inputs(_gdn_tokens, 2)
    reference = _chunk_reference("kvbuffer.reference.gdn", lambda a: (*a[:5], a[5], a[6]), 7)
    fitted = lambda shape: g.default_buffered_tunables(shape["K"], shape["V"])  # noqa: E731
    chunks = [Template(f"gdn_prefill_chunk{T}", "gdn", chunk(T), g.get_buffered_configs,
                       builder_defaults(g.gdn_buffered, tun), inputs(T), reference, _run, src, min_chunk=T,
                       fitted=fitted)
              for T in PREFILL_CHUNKS]
    return chunks + [
        Template("gdn_recurrent", "gdn", recurrent, g.get_recurrent_configs, builder_defaults(g.gdn_recurrent, tun),
                 _gdn_recurrent_inputs, _gdn_recurrent_reference, _run, src, uses_chunk=False),
        Template("gdn_buffered_step", "gdn", buffered, g.get_buffered_configs,
                 builder_defaults(g.gdn_buffered, tun), _gdn_buffered_inputs, _gdn_buffered_reference, _run, src,
                 fitted=fitted),
        Template("gdn_flush", "gdn", flush, g.get_flush_configs, builder_defaults(g.gdn_flush, tun),
                 _gdn_flush_inputs, _gdn_flush_reference, _run, src),
    ]


# ----------------------------------------------------------------------------------------------
# Mamba-2 (tiles/mamba2.py): G = Hk groups, H = Hv heads, N = K state size, P = V head dim; z not used.
# The buffered step and prefill chunks try two templates with one ABI (tunable `variant`).


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


def _m2_front_ref(args):
    x, dt, A_log, dt_bias, Bm, Cm, D = args[:7]
    return x[:, 0], dt[:, 0], A_log, dt_bias, Bm[:, 0], Cm[:, 0], D


def _m2_recurrent_reference(shape, chunk_size, args):
    from kvbuffer.reference import mamba2

    state = args[8].clone()
    y = mamba2.recurrent_step(*_m2_front_ref(args), state, args[9])
    return {8: state, 10: y[:, None]}


def _m2_buffered_inputs(shape, batch, chunk_size, device, gen):
    import torch

    front = _m2_tokens(shape, batch, gen, device)
    pools = _gdn_pools(shape, batch, chunk_size + 1, gen, device, 0, chunk_size)
    return front + [*pools, torch.empty_like(front[0])]


def _m2_buffered_reference(shape, chunk_size, args):
    from kvbuffer.reference import mamba2

    state, bk, bv, bg = (args[i].clone() for i in (8, 10, 11, 12))
    y = mamba2.buffered_step(*_m2_front_ref(args), state, args[9], bk, bv, bg, args[13], args[14],
                             flush_at=chunk_size)
    return {8: state, 15: y[:, None]}


def mamba2_templates() -> list[Template]:
    m = importlib.import_module(MAMBA2_TILES)
    src = source_digest()
    tun = ("BV", "threads")
    buffered_tun = ("variant", "BV", "threads", "blocks")
    fitted = lambda shape: m.default_buffered_tunables(shape["K"], shape["V"])  # noqa: E731

    def buffered_configs() -> list[dict]:
        """Both buffered variants, interleaved: the thread-level default (tiles/mamba2_simt.py, variant
        "simt"), then the generic template's (variant "reduce"), ...: `--max-configs 2` already times both,
        and the tuner keeps whichever is faster (and passes the reference check) per batch bucket."""
        return m.get_buffered_configs()

    def recurrent(shape, chunk_size, *, target, **t):
        return _compile(m.mamba2_recurrent(**_m2_dims(shape), in_dtype=shape["dtype"], **t), target)

    def buffered(shape, chunk_size, *, target, **t):
        prim = m.mamba2_buffered(**_m2_dims(shape), cap=chunk_size + 1, T_new=1, flush_at=chunk_size,
                                 in_dtype=shape["dtype"], buf_dtype=shape["dtype"], **t)
        return _compile(prim, target)

    def flush(shape, chunk_size, *, target, **t):
        return _compile(m.mamba2_flush(**_m2_dims(shape), cap=chunk_size + 1, buf_dtype=shape["dtype"], **t), target)

    def chunk(T):
        def build(shape, chunk_size, *, target, **t):
            prim = m.mamba2_buffered(**_m2_dims(shape), cap=chunk_size + 1, T_new=T, flush_at=chunk_size,
                                     in_dtype=shape["dtype"], buf_dtype=shape["dtype"], **t)
            return _compile(prim, target)
        return build

    inputs = _chunk_inputs(_m2_tokens, 0)
    reference = _chunk_reference("kvbuffer.reference.mamba2", lambda a: a[:7], 8)
    chunks = [Template(f"mamba2_prefill_chunk{T}", "mamba2", chunk(T), buffered_configs,
                       builder_defaults(m.mamba2_buffered, buffered_tun), inputs(T), reference, _run, src,
                       min_chunk=T, fitted=fitted)
              for T in PREFILL_CHUNKS]
    return chunks + [
        Template("mamba2_recurrent", "mamba2", recurrent, m.get_recurrent_configs,
                 builder_defaults(m.mamba2_recurrent, tun), _m2_recurrent_inputs, _m2_recurrent_reference, _run,
                 src, uses_chunk=False),
        Template("mamba2_buffered_step", "mamba2", buffered, buffered_configs,
                 builder_defaults(m.mamba2_buffered, buffered_tun), _m2_buffered_inputs, _m2_buffered_reference, _run,
                 src, fitted=fitted),
        Template("mamba2_flush", "mamba2", flush, m.get_flush_configs, builder_defaults(m.mamba2_flush, tun),
                 _gdn_flush_inputs, _gdn_flush_reference, _run, src),
    ]


def templates(family: str | None = None) -> list[Template]:
    """Every registered template (optionally of one family)."""
    found = gdn_templates()
    if importlib.util.find_spec(MAMBA2_TILES) is not None:
        found += mamba2_templates()
    return [t for t in found if family in (None, t.family)]
