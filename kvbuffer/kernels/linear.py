"""What the two linear families (Gated DeltaNet: kvbuffer.kernels.gdn, Mamba-2: kvbuffer.kernels.mamba2)
share: one spec each per op (recurrent step, buffered step / prefill chunk / verify, flush, recurrent
verify), keyed in the generic Hk, Hv, K, V; the keys of their calls; the flush launch; the checks that
read no tensor data; the engine's ops of a family; and the tuner's inputs.

The tuner builds, per buffer layout (C + T + 1 entries for T drafts), the decode step and the
PREFILL_CHUNKS prompt chunks (flush fused at C), the verify of T drafts plus the last token, the
stand-alone flush and the recurrent verify; the recurrent step once. A shape is
kvbuffer.tuning.make_shape's (Mamba-2: Hk = G, Hv = H, K = N, V = P); inputs are steady-state pools,
checked against kvbuffer.reference.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ..checks import INDEX_DTYPES, check_tensor
from ..reference import core as ref_core
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2
from .calls import EngineOp, capturing, on_torch_stream
from .keys import PREFILL_CHUNKS, KernelKey, dtype_name, linear_dims
from .lookup import kernel_for
from .specs import TILES, KernelSpec, TunerVariant, configs_of

BUFFER_MUTATIONS = ("state", "buf_k", "buf_v", "buf_g")  # what a buffered op writes

# ----------------------------------------------------------------------------------------------
# the specs


def _head_args(key: KernelKey) -> dict:
    d = key.dims
    return {"Hk": d.Hk, "Hv": d.Hv, "K": d.K, "V": d.V} if key.family == "gdn" else \
        {"G": d.G, "H": d.H, "N": d.N, "P": d.P}


def _with_z(key: KernelKey) -> dict:
    return {"has_z": key.has_z} if key.family == "mamba2" else {}


def _linear_params(key: KernelKey) -> dict:
    p = dict(**key.dims.record_fields(), cap=key.cap, T_new=key.T, flush_at=key.C, in_dtype=key.in_dtype,
             buf_dtype=key.buf_dtype, has_z=key.has_z)
    if key.family == "mamba2":
        d = key.dims
        p.update(G=d.G, H=d.H, N=d.N, P=d.P)
    return p


def _value_tile(key: KernelKey) -> dict:
    """The recurrent step's and the flush's untuned tiles: BV = 32, at most the head's V."""
    return {"BV": min(32, key.dims.record_fields()["V"]), "threads": 128}


def _buffered_defaults(key: KernelKey) -> dict:
    f = key.dims.record_fields()
    tiles = importlib.import_module(f"{TILES}.{key.family}")
    return tiles.default_buffered_tunables(f["K"], f["V"], key.T, f["Hv"] // f["Hk"])


def _drafts_defaults(key: KernelKey) -> dict:
    """The most threads the recurrent verify's front can lay its T x K token values out over."""
    fits = importlib.import_module(f"{TILES}.recurrent_drafts").fits_threads
    f = key.dims.record_fields()
    threads = next((n for n in (128, 64, 32) if fits(key.T * f["K"], n)), None)
    if threads is None:
        raise ValueError(f"no thread count in (128, 64, 32) lays out {key.T} tokens x K = {f['K']} for the "
                         "recurrent verify's front (K a multiple of 32 always fits)")
    return {"BV": min(32, f["V"]), "threads": threads}


GDN_FRONT = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
MAMBA2_FRONT = ("x", "dt", "A_log", "dt_bias", "B", "C", "D", "z")
STATE = ("state", "state_slots")
BUFFER = ("buf_k", "buf_v", "buf_g", "buffer_slots", "lengths")
DRAFTS = ("draft_states", "draft_rows")


def _linear_layouts(key: KernelKey) -> list:
    """The step and prefill chunks name C (flush_at), so drafts = cap - C - 1; a verify (no flush) is fed
    drafts + 1 = T tokens, so C = cap - T; a flush fits every split of its capacity (the first built is used)."""
    if key.op == "recurrent":
        return [(None, 0)]
    if key.op == "recurrent_drafts":
        return [(None, key.T - 1)]
    if key.op == "flush":
        return [(key.cap - 1 - d, d) for d in range(key.cap - 1)]
    if key.C:
        return [(key.C, key.cap - key.C - 1)] if key.cap > key.C else []
    return [(key.cap - key.T, key.T - 1)] if key.T > 1 and key.cap > key.T else []


def _linear_template(key: KernelKey) -> str | None:
    """The recurrent step, and per layout the decode step and PREFILL_CHUNKS prompt chunks (flush fused
    at C), the verify of T drafts + 1 and the flush: all without z, activations and entries of one dtype."""
    if key.has_z or (key.op == "buffered" and key.in_dtype != key.buf_dtype) or not _linear_layouts(key):
        return None
    if key.op != "buffered":
        return f"{key.family}_{key.op}"
    if key.C == 0:
        return f"{key.family}_verify"
    if key.T == 1:
        return f"{key.family}_buffered_step"
    return f"{key.family}_prefill_chunk{key.T}" if key.T in PREFILL_CHUNKS and key.C >= key.T else None


def _linear_command(key: KernelKey) -> str:
    layouts = _linear_layouts(key)
    C, drafts = layouts[0] if len(layouts) == 1 else (key.cap - 1, 0)
    heads = ",".join(str(n) for n in key.dims.record_fields().values())
    return (f"kvbuffer tune --gpu <gpu> --heads {heads}"
            + (f" --family {key.family}" if key.family != "gdn" else "")
            + (f" --dtype {key.dtype}" if key.dtype != "bfloat16" else "")
            + (f" --chunk-sizes {C}" if not key.op.startswith("recurrent") else "")
            + (f" --draft-tokens {drafts}" if drafts else ""))


def linear_shapes(key: KernelKey) -> list:
    return [{"family": key.family, **key.dims.record_fields(), "dtype": key.dtype}]  # tuning.make_shape's form


def linear_specs(family: str, front: tuple, out: str, reference) -> list[KernelSpec]:
    common = dict(module=family, family=family, params=_linear_params, layouts=_linear_layouts,
                  tune_template=_linear_template, record_shapes=linear_shapes, tune_command=_linear_command)
    return [
        KernelSpec(f"{family}_recurrent", op="recurrent", kind="recurrent",
                   template_args=lambda k: dict(_head_args(k), in_dtype=k.in_dtype, **_with_z(k)),
                   defaults=_value_tile, configs=configs_of(family, "get_recurrent_configs"),
                   args=front + STATE + (out,), reference=reference.recurrent_step,
                   custom_ops=(f"{family}_recurrent_step",), **common),
        KernelSpec(f"{family}_buffered", op="buffered", kind="buffered",
                   template_args=lambda k: dict(_head_args(k), cap=k.cap, T_new=k.T, flush_at=k.C,
                                                in_dtype=k.in_dtype, buf_dtype=k.buf_dtype, **_with_z(k)),
                   defaults=_buffered_defaults, configs=configs_of(family, "get_buffered_configs"),
                   args=front + STATE + BUFFER + (out,), reference=reference.verify,
                   custom_ops=(f"{family}_buffered_step", f"{family}_verify"), **common),
        KernelSpec(f"{family}_flush", op="flush", kind="flush",
                   template_args=lambda k: dict(_head_args(k), cap=k.cap, buf_dtype=k.buf_dtype),
                   defaults=_value_tile, configs=configs_of(family, "get_flush_configs"),
                   args=STATE + BUFFER, reference=ref_core.flush, custom_ops=(f"{family}_flush",), **common),
        KernelSpec(f"{family}_recurrent_drafts", op="recurrent_drafts", kind="recurrent_drafts",
                   template_args=lambda k: dict(_head_args(k), T_new=k.T, in_dtype=k.in_dtype, **_with_z(k)),
                   defaults=_drafts_defaults, configs=configs_of(family, "get_recurrent_configs"),
                   args=front + STATE + DRAFTS + (out,), reference=reference.recurrent_drafts,
                   custom_ops=(f"{family}_recurrent_drafts",), **common),
    ]


# ----------------------------------------------------------------------------------------------
# the keys of a call, the flush launch, the engine's ops and the checks that read no tensor data


def linear_key(spec: KernelSpec, key_t, val_t, buf_k=None, T=1, C=0, z=None) -> KernelKey:
    """The key of a linear op from its key-side tensor (k / B) and value-side tensor (v / x)."""
    dims = linear_dims(spec.family, key_t.shape[-2], val_t.shape[-2], key_t.shape[-1], val_t.shape[-1])
    cap = buf_k.shape[1] if buf_k is not None else 0
    return KernelKey(spec.family, spec.op, dims, dtype_name(val_t), dtype_name(buf_k) if buf_k is not None else "",
                     cap=cap, T=T, C=C, has_z=z is not None)


def flush_key(spec: KernelSpec, state, buf_k) -> KernelKey:
    dims = linear_dims(spec.family, buf_k.shape[2], state.shape[1], state.shape[2], state.shape[3])
    return KernelKey(spec.family, spec.op, dims, "", dtype_name(buf_k), cap=buf_k.shape[1])


def launch_flush(spec: KernelSpec, launcher, state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths, *,
                 checked=True) -> None:
    """Fold each row's lengths[b] buffer entries into its state with `spec`'s kernel (`launcher`: its
    validated launcher, run when `checked` outside a CUDA-graph capture)."""
    op = kernel_for(flush_key(spec, state, buf_k), buffer_slots.shape[0])
    args = (state, state_slots, buf_k, buf_v, buf_g, buffer_slots, lengths)
    if checked and not capturing():
        on_torch_stream(launcher, op, *args)
    else:
        on_torch_stream(op.fn, *args)


@dataclass(frozen=True)
class LinearOps:
    """A linear family's ops as the engine calls them."""

    recurrent_step: EngineOp
    buffered_step: EngineOp
    verify: EngineOp
    recurrent_drafts: EngineOp
    flush: EngineOp
    chunk_prefill: EngineOp


def meta_checks(name: str, args: dict) -> None:
    """Shapes, dtypes, parameter sizes and pool aliasing of one call of the linear op `name` (no tensor data
    read): a fake cannot read slots or fills, but it must still refuse what the real op refuses."""
    state = args["state"]
    if name.endswith("flush"):
        ref_core.check_flush_shapes(state, args["buf_k"], args["buf_v"], args["buf_g"])
        batch = args["buffer_slots"]
    else:
        if name.startswith("gdn"):
            ref_gdn.check_gates(state, args["v"], args["a"], args["b"], args["A_log"], args["dt_bias"])
            q, k, v, g = args["q"], args["k"], args["v"], args["a"]
        else:
            ref_mamba2.check_gates(state, args["x"], args["dt"], args["A_log"], args["dt_bias"], args["B"],
                                   args["C"], args["D"], args.get("z"))
            q, k, v, g = args["C"], args["B"], args["x"], args["dt"]
        buffers = None if "recurrent" in name else (args["buf_k"], args["buf_v"], args["buf_g"])
        with_time = name.endswith(("verify", "drafts"))
        ref_core.check_shapes(q, k, v, g, None, state, buffers, with_time=with_time)
        batch = q
        if name.endswith("drafts"):
            ref_core.check_draft_states(args["draft_states"], args["draft_rows"], state, q.shape[0], q.shape[1],
                                        values=False)
    check_tensor("state_slots", args["state_slots"], (batch.shape[0],), INDEX_DTYPES)
    for rows in ("buffer_slots", "lengths"):
        if rows in args:
            check_tensor(rows, args[rows], (batch.shape[0],), INDEX_DTYPES)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


def capacity(chunk_size: int, drafts: int = 0) -> int:
    """Buffer entries per slot in the engine's layout: C to fold, T drafts past them, one more token."""
    return chunk_size + drafts + 1


FRONTS = {"gdn": GDN_FRONT, "mamba2": MAMBA2_FRONT}
OUTPUTS = {"gdn": "o", "mamba2": "y"}


def _dims(shape: Mapping):
    return linear_dims(shape["family"], shape["Hk"], shape["Hv"], shape["K"], shape["V"])


def _of(family: str, fn: Callable) -> Callable:
    """`fn` for this family's templates: the shape it gets names the family."""
    return lambda shape, *args, **kwargs: fn({**shape, "family": family}, *args, **kwargs)


def _tokens(shape, batch, gen, device, T=1) -> dict:
    """A family's front arguments for T tokens per row (Mamba-2's z = x: kernels built without has_z ignore it)."""
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
    return torch.empty_like(front["v" if shape["family"] == "gdn" else "x"])


def _slots(batch, gen, device):
    return torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)


def _pools(shape, batch, cap, gen, device, lo, hi) -> dict:
    """State and buffer pools; row b's buffer holds lengths[b] in [lo, hi) entries (steady state)."""
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
    return ref_gdn if shape["family"] == "gdn" else ref_mamba2


def _front(shape, args: Mapping) -> list:
    """The reference's front arguments (Mamba-2's without z: the kernels are built without it)."""
    return [args[n] for n in FRONTS[shape["family"]] if n != "z"]


# ----------------------------------------------------------------------------------------------
# recurrent step


def _recurrent_inputs(shape, batch, chunk_size, device, gen) -> dict:
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
    state = args["state"].clone()
    ref_core.flush(state, *(args[n] for n in ("state_slots", "buf_k", "buf_v", "buf_g", "buffer_slots", "lengths")))
    return {"state": state}


def _drafts_inputs(shape, batch, chunk_size, device, gen, drafts=0) -> dict:
    """The front of drafts + 1 tokens, the state pool and its slots, a pool of per-token states and each
    row's place in it, the output."""
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


def linear_variants(family: str, specs: Mapping[str, KernelSpec], package: str) -> list[TunerVariant]:
    """Every tuner variant of `family` ("gdn" or "mamba2") but its chunked prefill (kvbuffer.kernels.prefill),
    built from `package`'s kernel templates; `specs`: its spec per op."""
    def buffered_key(T: int | None, fused: bool):
        return _of(family, lambda shape, chunk, drafts: KernelKey(
            family, "buffered", _dims(shape), shape["dtype"], shape["dtype"], cap=capacity(chunk, drafts),
            T=T or drafts + 1, C=chunk if fused else 0))

    def buffered(name: str, T: int | None, fused: bool, **extra) -> TunerVariant:
        options = dict(package=package, configs=_offered(specs["buffered"].configs, T), layouts=True, **extra)
        return TunerVariant(specs["buffered"], f"{family}_{name}", family, buffered_key(T, fused),
                            _of(family, _buffered_inputs(T)), _of(family, _buffered_reference(fused)), options)

    def key(op: str, **fields):
        return _of(family, lambda shape, chunk, drafts: KernelKey(
            family, op, _dims(shape), "" if op == "flush" else shape["dtype"],
            shape["dtype"] if op == "flush" else "", **{n: f(chunk, drafts) for n, f in fields.items()}))

    chunks = [buffered(f"prefill_chunk{T}", T, True, min_chunk=T) for T in PREFILL_CHUNKS]
    return chunks + [
        buffered("buffered_step", 1, True),
        buffered("verify", None, False, min_drafts=1),
        TunerVariant(specs["flush"], f"{family}_flush", family, key("flush", cap=capacity),
                     _of(family, _flush_inputs), _of(family, _flush_reference), dict(package=package, layouts=True)),
        TunerVariant(specs["recurrent"], f"{family}_recurrent", family, key("recurrent"),
                     _of(family, _recurrent_inputs), _of(family, _recurrent_reference),
                     dict(package=package, uses_chunk=False)),
        # a thread count its front cannot lay out for some T fails to build, and the tuner skips it as any
        # config that does not compile
        TunerVariant(specs["recurrent_drafts"], f"{family}_recurrent_drafts", family,
                     key("recurrent_drafts", T=lambda chunk, drafts: drafts + 1),
                     _of(family, _drafts_inputs), _of(family, _drafts_reference),
                     dict(package=package, uses_chunk=False, layouts=True, min_drafts=1)),
    ]
