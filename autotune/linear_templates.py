"""The linear families' tuner templates (GDN, Mamba-2), built from their KernelSpecs.

Per buffer layout (C + T + 1 entries for T drafts): the decode step and the PREFILL_CHUNKS prompt
chunks (flush fused at C), the verify of T drafts plus the last token, the stand-alone flush and the
recurrent verify; the recurrent step and the chunked prefill (kvbuffer.autotune.prefill_templates)
once. A shape is kvbuffer.tuning.make_shape's (Mamba-2: Hk = G, Hv = H, K = N, V = P); inputs are
steady-state pools, checked against kvbuffer.reference.
"""

from __future__ import annotations

from typing import Callable, Mapping

from kvbuffer.kernels.keys import PREFILL_CHUNKS, KernelKey, linear_dims
from kvbuffer.kernels.specs import GDN_FRONT, MAMBA2_FRONT, SPECS, TILES

from .prefill_templates import prefill_template
from .template import Template, capacity, from_spec

FRONTS = {"gdn": GDN_FRONT, "mamba2": MAMBA2_FRONT}
OUTPUTS = {"gdn": "o", "mamba2": "y"}


def _dims(shape: Mapping):
    return linear_dims(shape["family"], shape["Hk"], shape["Hv"], shape["K"], shape["V"])


def _of(family: str, fn: Callable) -> Callable:
    """`fn` for this family's templates: the shape it gets names the family."""
    return lambda shape, *args, **kwargs: fn({**shape, "family": family}, *args, **kwargs)


def _tokens(shape, batch, gen, device, T=1) -> dict:
    """A family's front arguments for T tokens per row (Mamba-2's z = x: kernels built without has_z ignore it)."""
    import torch

    dt = getattr(torch, shape["dtype"])
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    if shape["family"] == "gdn":
        q, k, v = r(batch, T, Hk, K).to(dt), r(batch, T, Hk, K).to(dt), r(batch, T, Hv, V).to(dt)
        a, b = r(batch, T, Hv).to(dt), r(batch, T, Hv).to(dt)
        A_log = torch.log(1.0 + 15.0 * torch.rand(Hv, generator=gen, device=device))
        dt_bias = torch.log(torch.expm1(0.001 + 0.099 * torch.rand(Hv, generator=gen, device=device)))
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    x, dt_ = r(batch, T, Hv, V).to(dt), r(batch, T, Hv).to(dt)
    A_log = torch.log(1.0 + 15.0 * torch.rand(Hv, generator=gen, device=device))
    dt_bias = torch.log(torch.expm1(0.001 + 0.099 * torch.rand(Hv, generator=gen, device=device)))
    Bm, Cm, D = r(batch, T, Hk, K).to(dt), r(batch, T, Hk, K).to(dt), r(Hv)
    return dict(x=x, dt=dt_, A_log=A_log, dt_bias=dt_bias, B=Bm, C=Cm, D=D, z=x)


def _output(shape, front: dict):
    import torch

    return torch.empty_like(front["v" if shape["family"] == "gdn" else "x"])


def _slots(batch, gen, device):
    import torch

    return torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)


def _pools(shape, batch, cap, gen, device, lo, hi) -> dict:
    """State and buffer pools; row b's buffer holds lengths[b] in [lo, hi) entries (steady state)."""
    import torch

    dt = getattr(torch, shape["dtype"])
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    state = 0.5 * torch.randn(batch, Hv, K, V, generator=gen, device=device)
    kk = torch.nn.functional.normalize(torch.randn(batch, cap, Hk, K, generator=gen, device=device), dim=-1)
    buf_v = (0.5 * torch.randn(batch, cap, Hv, V, generator=gen, device=device)).to(dt)
    buf_g = torch.cumsum(-(0.02 + 0.5 * torch.rand(batch, cap, Hv, generator=gen, device=device)), dim=1)
    slots = _slots(batch, gen, device)
    lengths = torch.randint(lo, hi, (batch,), generator=gen, device=device, dtype=torch.int32)
    return dict(state=state, state_slots=slots, buf_k=kk.to(dt), buf_v=buf_v, buf_g=buf_g, buffer_slots=slots.clone(),
                lengths=lengths)


def _ops(shape):
    from kvbuffer.reference import gdn, mamba2

    return gdn if shape["family"] == "gdn" else mamba2


def _front(shape, args: Mapping) -> list:
    """The reference's front arguments (Mamba-2's without z: the kernels are built without it)."""
    return [args[n] for n in FRONTS[shape["family"]] if n != "z"]


# ----------------------------------------------------------------------------------------------
# recurrent step


def _recurrent_inputs(shape, batch, chunk_size, device, gen) -> dict:
    import torch

    front = _tokens(shape, batch, gen, device)
    state = 0.5 * torch.randn(batch, shape["Hv"], shape["K"], shape["V"], generator=gen, device=device)
    return {**front, "state": state, "state_slots": _slots(batch, gen, device),
            OUTPUTS[shape["family"]]: _output(shape, front)}


def _recurrent_reference(shape, chunk_size, args: Mapping) -> dict:
    state = args["state"].clone()
    front = [t[:, 0] if t.dim() > 1 else t for t in _front(shape, args)]
    o = _ops(shape).recurrent_step(*front, state, args["state_slots"])
    return {"state": state, OUTPUTS[shape["family"]]: o[:, None]}


# ----------------------------------------------------------------------------------------------
# buffered kernels: decode step, prefill chunks, verify


def _buffered_inputs(T: int | None) -> Callable[..., dict]:
    """Inputs of a buffered kernel fed T tokens per row (None: a verify of drafts + 1 tokens). With a
    fused flush at C, rows hold n <= C - T entries, so some reach C and fold; a verify's rows hold n < C."""
    def inputs(shape, batch, chunk_size, device, gen, drafts=0):
        fed = T or drafts + 1
        hi = chunk_size if T is None else chunk_size - T + 1
        front = _tokens(shape, batch, gen, device, fed)
        pools = _pools(shape, batch, capacity(chunk_size, drafts), gen, device, 0, hi)
        return {**front, **pools, OUTPUTS[shape["family"]]: _output(shape, front)}
    return inputs


def _buffered_reference(flush: bool) -> Callable[..., dict]:
    """The reference verify of the kernel's tokens; with `flush`, then the fold of the rows whose buffer
    reached C (decode step, prefill chunk); without, a verify, whose new buffer entries are checked too."""
    def reference(shape, chunk_size, args: Mapping) -> dict:
        import torch

        ops, out = _ops(shape), OUTPUTS[shape["family"]]
        state, bk, bv, bg = (args[n].clone() for n in ("state", "buf_k", "buf_v", "buf_g"))
        sslots, bslots, lengths = args["state_slots"], args["buffer_slots"], args["lengths"]
        T = _front(shape, args)[0].shape[1]
        o = ops.verify(*_front(shape, args), state, sslots, bk, bv, bg, bslots, lengths)
        if not flush:
            return {"state": state, "buf_k": bk, "buf_v": bv, "buf_g": bg, out: o}
        full = torch.where((lengths + T == chunk_size) & (bslots >= 0), bslots, torch.full_like(bslots, -1))
        ops.flush(state, sslots, bk, bv, bg, full, lengths + T)
        return {"state": state, out: o}
    return reference


def _offered(configs: Callable[[], list], T: int | None) -> Callable[[], list]:
    """The configs tuned for a kernel of T tokens (None: a verify): all, except that the decode step
    (T = 1) is not offered the tensor-core products (they pay only for wide verifies; docs/kernels.md)
    nor GDN's `lean`, which needs two tokens."""
    if T != 1:
        return configs
    return lambda: [c for c in configs() if not c.get("tensor_cores") and not c.get("lean")]


# ----------------------------------------------------------------------------------------------
# flush and recurrent verify


def _flush_inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
    """Rows hold 1 .. C + T entries (after a verify, a buffer may pass C by the accepted drafts)."""
    cap = capacity(chunk_size, drafts)
    return _pools(shape, batch, cap, gen, device, 1, cap)


def _flush_reference(shape, chunk_size, args: Mapping) -> dict:
    from kvbuffer.reference import core

    state = args["state"].clone()
    core.flush(state, *(args[n] for n in ("state_slots", "buf_k", "buf_v", "buf_g", "buffer_slots", "lengths")))
    return {"state": state}


def _drafts_inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
    """The front of drafts + 1 tokens, the state pool and its slots, a pool of per-token states and each
    row's place in it, the output."""
    import torch

    fed = drafts + 1
    front = _tokens(shape, batch, gen, device, fed)
    Hv, K, V = shape["Hv"], shape["K"], shape["V"]
    state = 0.5 * torch.randn(batch, Hv, K, V, generator=gen, device=device)
    slots, rows = _slots(batch, gen, device), _slots(batch, gen, device)
    pool = torch.zeros(batch, fed, Hv, K, V, device=device)
    return {**front, "state": state, "state_slots": slots, "draft_states": pool, "draft_rows": rows,
            OUTPUTS[shape["family"]]: _output(shape, front)}


def _drafts_reference(shape, chunk_size, args: Mapping) -> dict:
    pool = args["draft_states"].clone()
    o = _ops(shape).recurrent_drafts(*_front(shape, args), args["state"], args["state_slots"], pool,
                                     args["draft_rows"])
    return {"draft_states": pool, OUTPUTS[shape["family"]]: o}


# ----------------------------------------------------------------------------------------------


def linear_templates(family: str, package: str = TILES) -> list[Template]:
    """Every template of `family` ("gdn" or "mamba2"), built from `package`'s kernel templates."""
    spec = {op: SPECS[(family, op)] for op in ("recurrent", "buffered", "flush", "recurrent_drafts")}

    def buffered_key(T: int | None, fused: bool):
        return _of(family, lambda shape, chunk, drafts: KernelKey(
            family, "buffered", _dims(shape), shape["dtype"], shape["dtype"], cap=capacity(chunk, drafts),
            T=T or drafts + 1, C=chunk if fused else 0))

    def buffered(name: str, T: int | None, fused: bool, **extra) -> Template:
        return from_spec(spec["buffered"], f"{family}_{name}", family, buffered_key(T, fused), _of(family, _buffered_inputs(T)),
                         _of(family, _buffered_reference(fused)), package=package,
                         configs=_offered(spec["buffered"].configs, T), layouts=True, **extra)

    chunks = [buffered(f"prefill_chunk{T}", T, True, min_chunk=T) for T in PREFILL_CHUNKS]
    return chunks + [
        buffered("buffered_step", 1, True),
        buffered("verify", None, False, min_drafts=1),
        from_spec(spec["flush"], f"{family}_flush", family,
                  _of(family, lambda shape, chunk, drafts: KernelKey(family, "flush", _dims(shape), "", shape["dtype"],
                                                                     cap=capacity(chunk, drafts))),
                  _of(family, _flush_inputs), _of(family, _flush_reference), package=package, layouts=True),
        from_spec(spec["recurrent"], f"{family}_recurrent", family,
                  _of(family, lambda shape, chunk, drafts: KernelKey(family, "recurrent", _dims(shape), shape["dtype"])),
                  _of(family, _recurrent_inputs), _of(family, _recurrent_reference), package=package, uses_chunk=False),
        # a thread count its front cannot lay out for some T fails to build, and the tuner skips it as any
        # config that does not compile
        from_spec(spec["recurrent_drafts"], f"{family}_recurrent_drafts", family,
                  _of(family, lambda shape, chunk, drafts: KernelKey(family, "recurrent_drafts", _dims(shape),
                                                                     shape["dtype"], T=drafts + 1)),
                  _of(family, _drafts_inputs), _of(family, _drafts_reference), package=package, uses_chunk=False, layouts=True, min_drafts=1),
        prefill_template(family, package),
    ]


def gdn_templates(package: str = TILES) -> list[Template]:
    return linear_templates("gdn", package)


def mamba2_templates(package: str = TILES) -> list[Template]:
    return linear_templates("mamba2", package)
