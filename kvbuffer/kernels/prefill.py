"""The chunked prefill of packed prompts (tiles/gdn_prefill.py), for both linear families (each registers
its own with its other kernels: kvbuffer.kernels.gdn, .mamba2): its specs, compile, validated launch,
reference, CUDA launches, engine ops, custom ops and tuner inputs.

One op per linear family: the plain recurrence of kvbuffer.reference.core over each sequence of a packed
batch. Sequence i (tokens cu_seqlens[i] .. cu_seqlens[i+1] - 1) starts from state[state_slots[i]] (zero for
slot -1), its outputs (N, Hv, V) are written and its final state goes back into its slot in place (nothing
for slot -1). Value head h reads key head h // (Hv // Hk); each step's log decay is clamped at
LOG_DECAY_FLOOR.

- Gated DeltaNet (delta rule, `chunk_prefill`), after its gating front: q, k (N, Hk, K) L2-normalised, q
  scaled by K**-0.5; v (N, Hv, V); g, beta (N, Hv). Its KernelKey is ("gdn", "chunk_prefill").
- Mamba-2's SSD (decay-only, `mamba2_chunk_prefill`), its front and D skip inside: the raw x (N, H, P),
  dt (N, H), B, C (N, G, N_state) and the layer's A_log, dt_bias, D (H,); dt = clamp(softplus(dt + dt_bias),
  dt_min, dt_max) (dt_max None: no upper limit), the recurrence's q = C, k = B, v = dt x, g = -exp(A_log) dt,
  and y = o + D x. A sequence on slot -1 is a padding row: zero outputs. The z gate stays outside.
  ("mamba2", "chunk_prefill").

On CUDA: q, k, v (x, B, C) bf16, g, beta (dt) and the parameters fp32, cu_seqlens and state_slots int32,
state fp32, four launches (three decay-only) of the templates of a CompiledOp of kind "chunk_prefill" whose
`fn` maps part names to compiled functions. `chunk_prefill_reference` / `mamba2_chunk_prefill_reference` are
the same contracts in torch for any float dtype.

    torch.ops.kvbuffer.gdn_chunk_prefill(q, k, v, g, beta, cu_seqlens, state, state_slots) -> o (N, Hv, V)
    torch.ops.kvbuffer.mamba2_chunk_prefill(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                            dt_min=0.0, dt_max=None) -> y (N, H, P)

mutate `state`. The tuner builds each once per shape for every chunk size (C plays no part) and stores it as
one artifact per launch; its inputs are a packed prefill of about PREFILL_TOKENS tokens spread over the
batch's sequences (awkward lengths), each from a state slot of its own, checked against the references in
fp64: outputs and final states.
"""

from __future__ import annotations

import importlib
import math
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from ..checks import FLOAT_DTYPES, INDEX_DTYPES, check_slots, check_tensor, check_unique
from ..errors import ShapeError
from ..reference import chunked
from ..reference.gating import mamba2_front
from .calls import EngineOp, capturing, implement, on_torch_stream
from .compiled import CompiledOp, check_contiguous, check_on_cuda, expect_kind
from .keys import KernelKey, linear_dims
from .linear import linear_shapes
from .lookup import kernel_for
from .specs import TILES, KernelSpec, TunerVariant

CHUNK = 64  # tiles.gdn_prefill.BT (that module imports TileLang's front end lazily, this one never)
CHUNK_FIELDS = 3  # tiles.gdn_prefill.CHUNK_FIELDS: a chunk table row (first token, tokens, sequence)
HEAD_DIMS = (32, 64, 128)  # K and V the templates take (16: 4 warps cannot split a 16 x 16 tile; 256 untested)


# ----------------------------------------------------------------------------------------------
# the specs: four launches, three decay-only (Mamba-2's, from the layer's raw x, dt and parameters)


PREFILL_TUNABLES = ("states_BV", "states_stages", "output_BV", "threads", "prep_solve", "staged_stores", "heads_inner")
# where a config (or an artifact tuned before the tunable was) names none
_PREFILL_DEFAULTS = {"states_stages": 0, "threads": 128, "prep_solve": "substitution", "staged_stores": 0,
                     "heads_inner": 0}


def prefill_tunables(key: KernelKey, given: dict | None = None) -> dict:
    """The chunked prefill's tunables for `key`: its defaults (the templates' first config over
    _PREFILL_DEFAULTS) with `given` over them, each value tile capped at the head's V and halved until it divides V.
    Unknown names are a TypeError."""
    unknown = set(given or {}) - set(PREFILL_TUNABLES)
    if unknown:
        raise TypeError(f"unknown chunked prefill tunables {sorted(unknown)}; they are {PREFILL_TUNABLES}")
    t = dict(given or {})
    if {"states_BV", "output_BV"} - set(t):  # an artifact names both: the run time imports no template here
        t = {**importlib.import_module(f"{TILES}.gdn_prefill").configs()[0], **t}
    t = {**_PREFILL_DEFAULTS, **t}
    V = key.dims.record_fields()["V"]
    return dict(t, states_BV=_dividing_tile(t["states_BV"], V), output_BV=_dividing_tile(t["output_BV"], V))


PIPELINED_ARCHS = ("sm_90a",)  # where the pipelined state passes compile (their chunk loads are TMA copies)
STAGED_ARCHS = ("sm_90a",)  # where the staged stores (`staged_stores`) were measured faster


def pipelines(key: KernelKey, arch: str) -> bool:
    """Whether the pipelined state pass compiles for `key` on `arch`: a TMA arch, and whole boxes of GW
    heads' decays (gdn_prefill_states)."""
    boxes = importlib.import_module(f"{TILES}.gdn_prefill").GW
    return arch in PIPELINED_ARCHS and key.dims.record_fields()["Hv"] % boxes == 0


def _target_defaults(key: KernelKey, arch: str) -> dict:
    """Measured on sm_90a (docs/results.md): the state pass pipelined where it compiles (both families), the
    prep's and the output's results written staged (both), and Mamba-2's output pass with a chunk's value
    heads on consecutive blocks (`heads_inner`; GDN's is unmeasured). The tuner measures all of them."""
    defaults = {"states_stages": 2} if pipelines(key, arch) else {}
    if arch in STAGED_ARCHS:
        defaults["staged_stores"] = 1
    if arch in PIPELINED_ARCHS and key.family == "mamba2":
        defaults["heads_inner"] = 1
    return defaults


def _dividing_tile(BV: int, V: int) -> int:
    """BV, halved until it divides V (V a multiple of 16, so 16 always does)."""
    BV = min(BV, V)
    while V % BV and BV > 16:
        BV //= 2
    return BV


def _prefill_configs(family: str) -> Callable[[], list]:
    """The templates' configs, each complete (so a tuned artifact's tunables are); the decay-only form has
    no prep (so no prep solve)."""
    def configs() -> list:
        found = [{**_PREFILL_DEFAULTS, **c} for c in importlib.import_module(f"{TILES}.gdn_prefill").configs()]
        return [c for c in found if family == "gdn" or c["prep_solve"] == _PREFILL_DEFAULTS["prep_solve"]]
    return configs


def _prefill_parts(key: KernelKey) -> tuple:
    return ("chunks", "prep", "states", "output") if key.family == "gdn" else ("chunks", "states", "output")


def _prefill_templates(tiles, key: KernelKey, t: dict) -> dict:
    """The launches of one chunked prefill: the chunk table, GDN's prep, the state pass, the output."""
    dims = key.dims.record_fields()
    delta_rule = key.family == "gdn"
    prims = {"chunks": tiles.gdn_prefill_chunks(threads=t["threads"])}
    if delta_rule:
        prims["prep"] = tiles.gdn_prefill_prep(**dims, threads=t["threads"], solve=t["prep_solve"],
                                               heads_inner=t["heads_inner"], staged=t["staged_stores"])
    prims["states"] = tiles.gdn_prefill_states(**dims, BV=t["states_BV"], threads=t["threads"],
                                               stages=t["states_stages"], delta_rule=delta_rule)
    prims["output"] = tiles.gdn_prefill_output(**dims, BV=t["output_BV"], threads=t["threads"], delta_rule=delta_rule,
                                               heads_inner=t["heads_inner"], staged=t["staged_stores"])
    return prims


def _prefill_args(key: KernelKey) -> dict:
    return dict(key.dims.record_fields(), delta_rule=key.family == "gdn")


def _prefill_shapes(key: KernelKey) -> list:
    """Its kernels run bf16 whatever the model's activations, so a bf16 or an fp16 record can hold them."""
    return [dict(linear_shapes(key)[0], dtype=dtype) for dtype in ("bfloat16", "float16")]


def _prefill_command(key: KernelKey) -> str:
    heads = ",".join(str(n) for n in key.dims.record_fields().values())
    return f"kvbuffer tune --gpu <gpu> --heads {heads}" + (f" --family {key.family}" if key.family != "gdn" else "")


def _spec(family: str, args: tuple) -> KernelSpec:
    """Its reference is the CPU op's (chunk_prefill_reference); `kvbuffer tune` stores it as one artifact
    per launch, one layout for every chunk size."""
    return KernelSpec(f"{family}_chunk_prefill", "gdn_prefill", family, "chunk_prefill", "chunk_prefill",
                      template_args=_prefill_args, defaults=prefill_tunables, target_defaults=_target_defaults,
                      configs=_prefill_configs(family),
                      params=_prefill_args, args=args, custom_ops=(f"{family}_chunk_prefill",),
                      tune_template=lambda k: f"{k.family}_chunk_prefill", record_shapes=_prefill_shapes,
                      tune_command=_prefill_command, complete_tunables=prefill_tunables, parts=_prefill_parts,
                      part_templates=_prefill_templates)


GDN_CHUNK_PREFILL = _spec("gdn", ("q", "k", "v", "g", "beta", "cu_seqlens", "state", "state_slots", "o"))
MAMBA2_CHUNK_PREFILL = _spec("mamba2", ("x", "dt", "A_log", "dt_bias", "B", "C", "D", "cu_seqlens", "state",
                                                "state_slots", "y"))  # its front and D skip inside
SPECS = {"gdn": GDN_CHUNK_PREFILL, "mamba2": MAMBA2_CHUNK_PREFILL}


# ----------------------------------------------------------------------------------------------
# compile, validated launch, the references


def fits(K: int, V: int) -> bool:
    """Whether the templates take key and value head dims K, V (HEAD_DIMS)."""
    return K in HEAD_DIMS and V in HEAD_DIMS


def build_gdn_chunk_prefill(Hk: int, Hv: int, K: int = 128, V: int = 128, *, delta_rule: bool = True,
                            **tunables) -> CompiledOp:
    """Compile the chunked prefill for one head shape for the local GPU: the delta rule (GDN's key) or,
    with delta_rule=False, the decay-only form (Mamba-2's key with G = Hk, H = Hv, N = K, P = V).
    Tunables (the spec's defaults for those not given; value tiles capped at V): states_BV, states_stages,
    output_BV, threads."""
    family = "gdn" if delta_rule else "mamba2"
    key = KernelKey(family, "chunk_prefill", linear_dims(family, Hk, Hv, K, V), "bfloat16")
    return SPECS[family].build(key, tunables)


def build_mamba2_chunk_prefill(G: int, H: int, N: int = 128, P: int = 64, **tunables) -> CompiledOp:
    """Compile Mamba-2's chunked prefill (the decay-only form) for G groups, H heads, state size N, head dim P."""
    return build_gdn_chunk_prefill(G, H, N, P, delta_rule=False, **tunables)


def chunk_slots(num_tokens: int, batch: int) -> int:
    """Rows of the per-chunk workspace: chunk c of sequence i owns row cu_seqlens[i] // CHUNK + i + c, below
    ceil(N / CHUNK) + B (tiles.gdn_prefill's module docstring)."""
    return -(-num_tokens // CHUNK) + batch


# ----------------------------------------------------------------------------------------------
# checks


def check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, *, delta_rule: bool) -> None:
    """Shapes, dtype kinds and devices (what a fake can check): every tensor on state's device."""
    if not delta_rule and beta is not None:
        raise TypeError("beta must be None for the decay-only form (Mamba-2)")
    if delta_rule and beta is None:
        raise TypeError("beta (N, Hv) is required for the delta rule (GDN)")
    chunked.check_packed(q, k, v, g, beta, state)
    _check_offsets(cu_seqlens, state, state_slots)


def _check_offsets(cu_seqlens, state, state_slots) -> None:
    dev = state.device
    check_tensor("cu_seqlens", cu_seqlens, (None,), INDEX_DTYPES, dev)
    if cu_seqlens.shape[0] < 2:
        raise ShapeError(f"cu_seqlens must hold B + 1 >= 2 offsets, got shape {tuple(cu_seqlens.shape)}")
    check_tensor("state_slots", state_slots, (cu_seqlens.shape[0] - 1,), INDEX_DTYPES, dev)


def check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min: float = 0.0,
                        dt_max: float | None = None) -> None:
    """Mamba-2's op (what a fake can check): x (N, H, P), dt (N, H), B, C (N, G, N_state), A_log, dt_bias, D
    (H,) against state (slots, H, N_state, P), every tensor on state's device; dt_min <= dt_max, both finite
    and dt_min >= 0 (dt_max None: no upper limit)."""
    chunked.check_packed(C, B, x, dt, None, state)
    H = state.shape[1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_tensor(name, t, (H,), FLOAT_DTYPES, state.device)
    _check_offsets(cu_seqlens, state, state_slots)
    if not (math.isfinite(dt_min) and dt_min >= 0.0):
        raise ValueError(f"dt_min must be a finite float >= 0, got {dt_min!r}")
    if dt_max is not None and not (math.isfinite(dt_max) and dt_max >= dt_min):
        raise ValueError(f"dt_max must be None or a finite float >= dt_min = {dt_min!r}, got {dt_max!r}")


def check_rows(cu_seqlens, state, state_slots, N: int) -> None:
    """The checks that read cu_seqlens and state_slots back: offsets rising from 0 to N, slots in
    [-1, num_slots) and distinct."""
    c = cu_seqlens.tolist()
    if c[0] != 0 or c[-1] != N or any(b < a for a, b in zip(c, c[1:])):
        raise ShapeError(f"cu_seqlens must rise from 0 to the {N} packed tokens, got {c[:8]}"
                         + (" ..." if len(c) > 8 else ""))
    check_slots("state_slots", state_slots, len(c) - 1, state.shape[0], state.device)
    check_unique("state_slots", state_slots)


def _check_kernel(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots) -> None:
    """The compiled kernels' own demands: their head shape, bf16 activations, fp32 gates and state, int32
    offsets and slots, contiguous tensors on CUDA."""
    expect_kind(op, "chunk_prefill")
    p = op.params
    if not p["delta_rule"]:
        raise TypeError("a decay-only kernel (Mamba-2) runs through mamba2_chunk_prefill, not chunk_prefill")
    dev = q.device if isinstance(q, torch.Tensor) else None
    check_tensor("q", q, (None, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_on_cuda("q", dev)
    N = q.shape[0]
    check_tensor("k", k, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("v", v, (N, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_tensor("g", g, (N, p["Hv"]), (torch.float32,), dev)
    check_tensor("beta", beta, (N, p["Hv"]), (torch.float32,), dev)
    _check_kernel_rows(p, cu_seqlens, state, state_slots, dev)
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, delta_rule=True)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_contiguous(name, t)
    check_tma_aligned(op, k=k)


TMA_ALIGNMENT = 16  # bytes: where a TMA copy's global tensor may start


def check_tma_aligned(op: CompiledOp, **tensors: torch.Tensor) -> None:
    """A pipelined state pass (states_stages > 0) loads these tensors by TMA, whose global addresses
    must be 16-byte aligned: one that starts elsewhere (a view at an odd element offset) is a
    ShapeError here, not a fault on the device."""
    if not op.params.get("states_stages"):
        return
    for name, t in tensors.items():
        if t.data_ptr() % TMA_ALIGNMENT:
            raise ShapeError(f"{name} starts at an address that is not a multiple of {TMA_ALIGNMENT} bytes (a view "
                             f"at an odd offset?): the pipelined state pass loads it by TMA; pass a copy (.clone())")


def _check_kernel_rows(p: dict, cu_seqlens, state, state_slots, dev) -> None:
    check_tensor("cu_seqlens", cu_seqlens, (None,), (torch.int32,), dev)
    check_tensor("state", state, (None, p["Hv"], p["K"], p["V"]), (torch.float32,), dev)
    check_tensor("state_slots", state_slots, None, (torch.int32,))
    for name, t in (("cu_seqlens", cu_seqlens), ("state", state), ("state_slots", state_slots)):
        check_contiguous(name, t)


def _check_mamba2_kernel(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min,
                         dt_max) -> None:
    """The decay-only kernels' own demands: their head shape, bf16 x, B, C, fp32 dt, parameters and state,
    int32 offsets and slots, contiguous tensors on CUDA."""
    expect_kind(op, "chunk_prefill")
    p = op.params
    if p["delta_rule"]:
        raise TypeError("a delta-rule kernel (GDN) runs through chunk_prefill, not mamba2_chunk_prefill")
    dev = x.device if isinstance(x, torch.Tensor) else None
    check_tensor("x", x, (None, p["Hv"], p["V"]), (torch.bfloat16,), dev)
    check_on_cuda("x", dev)
    N = x.shape[0]
    check_tensor("dt", dt, (N, p["Hv"]), (torch.float32,), dev)
    check_tensor("B", B, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    check_tensor("C", C, (N, p["Hk"], p["K"]), (torch.bfloat16,), dev)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("D", D)):
        check_tensor(name, t, (p["Hv"],), (torch.float32,), dev)
    _check_kernel_rows(p, cu_seqlens, state, state_slots, dev)
    check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    for name, t in (("x", x), ("dt", dt), ("A_log", A_log), ("dt_bias", dt_bias), ("B", B), ("C", C), ("D", D)):
        check_contiguous(name, t)
    check_tma_aligned(op, x=x, dt=dt, B=B)


# ----------------------------------------------------------------------------------------------
# the launch and the reference


def chunk_prefill(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots, out=None, *,
                  check_values: bool = True) -> torch.Tensor:
    """GDN's o (N, Hv, V) bf16 of every packed sequence; each sequence's final state written to its slot in
    place.

    `check_values` = False skips the checks that read cu_seqlens and state_slots back (monotone offsets
    from 0 to N, slots in [-1, num_slots) and distinct), for engine-built rows and CUDA graph capture.
    """
    _check_kernel(op, q, k, v, g, beta, cu_seqlens, state, state_slots)
    N = q.shape[0]
    if check_values:
        check_rows(cu_seqlens, state, state_slots, N)
    out = _out(out, N, op.params["Hv"], op.params["V"], q.device)
    if N == 0:
        return out
    for part, args in gdn_launches(op, q, k, v, g, beta, cu_seqlens, state, state_slots, out):
        op.fn[part](*args)
    return out


def gdn_launches(op: CompiledOp, q, k, v, g, beta, cu_seqlens, state, state_slots, out) -> list[tuple[str, tuple]]:
    """GDN's launches in order, (part, its arguments), their workspace allocated (no checks: chunk_prefill's
    body, and what a per-launch timing replays)."""
    N, B, p = q.shape[0], cu_seqlens.shape[0] - 1, op.params
    chunks, gcum, h = _workspace(op, N, B, q.device)
    w = torch.empty((N, p["Hv"], p["K"]), dtype=torch.bfloat16, device=q.device)
    u, delta = (torch.empty((N, p["Hv"], p["V"]), dtype=torch.bfloat16, device=q.device) for _ in range(2))
    return [("chunks", (cu_seqlens, chunks)), ("prep", (k, v, g, beta, chunks, w, u, gcum)),
            ("states", (k, w, u, gcum, cu_seqlens, state, state_slots, h, delta)),
            ("output", (q, k, h, delta, gcum, chunks, out))]


def _workspace(op: CompiledOp, N: int, B: int, device) -> tuple:
    """The chunk table (chunk slots, CHUNK_FIELDS) int32, the cumulative decays (N, Hv) fp32 and the chunks'
    starting states (chunk slots, Hv, K, V) bf16."""
    p, NC = op.params, chunk_slots(N, B)
    return (torch.empty((NC, CHUNK_FIELDS), dtype=torch.int32, device=device),
            torch.empty((N, p["Hv"]), dtype=torch.float32, device=device),
            torch.empty((NC, p["Hv"], p["K"], p["V"]), dtype=torch.bfloat16, device=device))


def _out(out, N: int, Hv: int, V: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty((N, Hv, V), dtype=torch.bfloat16, device=device)
    check_tensor("out", out, (N, Hv, V), (torch.bfloat16,), device)
    check_contiguous("out", out)
    return out


def mamba2_chunk_prefill(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                         dt_min: float = 0.0, dt_max: float | None = None, out=None, *,
                         check_values: bool = True) -> torch.Tensor:
    """Mamba-2's y (N, H, P) bf16 of every packed sequence, its front and D skip inside (module docstring);
    each sequence's final state written to its slot in place. `check_values` as chunk_prefill's."""
    _check_mamba2_kernel(op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    N = x.shape[0]
    if check_values:
        check_rows(cu_seqlens, state, state_slots, N)
    out = _out(out, N, op.params["Hv"], op.params["V"], x.device)
    if N == 0:
        return out
    for part, args in mamba2_launches(op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min,
                                      dt_max, out):
        op.fn[part](*args)
    return out


def mamba2_launches(op: CompiledOp, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max,
                    out) -> list[tuple[str, tuple]]:
    """Mamba-2's launches in order, as gdn_launches'."""
    chunks, gcum, h = _workspace(op, x.shape[0], cu_seqlens.shape[0] - 1, x.device)
    dts = torch.empty_like(gcum)
    hi = math.inf if dt_max is None else float(dt_max)
    return [("chunks", (cu_seqlens, chunks)),
            ("states", (x, dt, A_log, dt_bias, B, cu_seqlens, state, state_slots, h, gcum, dts, float(dt_min), hi)),
            ("output", (C, B, h, x, D, gcum, dts, chunks, state_slots, out))]


def chunk_prefill_reference(q, k, v, g, beta, cu_seqlens, state, state_slots) -> torch.Tensor:
    """The op's contract in torch (any float dtypes; computed in the state's): o (N, Hv, V) in v's dtype.

    The chunkwise form of kvbuffer.reference.chunked with a flush point after every token, so every token
    folds, from each sequence's starting state gathered into a pool of its own.
    """
    check_shapes(q, k, v, g, beta, cu_seqlens, state, state_slots, delta_rule=beta is not None)
    N, B = q.shape[0], cu_seqlens.shape[0] - 1
    check_rows(cu_seqlens, state, state_slots, N)
    dev = state.device
    real = state_slots >= 0
    start = state[state_slots.clamp(min=0).long()]
    start[~real] = 0
    rows = torch.arange(B, dtype=torch.int64, device=dev)
    Hk, K, Hv, V = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    unused = [torch.zeros((B, 1) + rest, dtype=state.dtype, device=dev) for rest in ((Hk, K), (Hv, V), (Hv,))]
    o, _ = chunked.prefill(q, k, v, g, beta, cu_seqlens, start, rows, *unused, rows, torch.zeros_like(rows), 1)
    state[state_slots[real].long()] = start[real]
    return o


def mamba2_chunk_prefill_reference(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                   dt_min: float = 0.0, dt_max: float | None = None) -> torch.Tensor:
    """Mamba-2's op in torch (any float dtypes; computed in the state's): y (N, H, P) in x's dtype.

    The front of kvbuffer.reference.gating.mamba2_front (dt clamped to [dt_min, dt_max]), a padding row's
    (slot -1) dt zeroed, chunk_prefill_reference's recurrence, then y = o + D x (zero for a padding row)."""
    check_mamba2_shapes(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min, dt_max)
    N = x.shape[0]
    check_rows(cu_seqlens, state, state_slots, N)
    real = torch.repeat_interleave(state_slots >= 0, cu_seqlens.diff().long(), output_size=N).to(state.dtype)
    hi = math.inf if dt_max is None else dt_max
    value, g, _ = mamba2_front(x, dt, A_log, dt_bias, state.dtype, dt_limits=(dt_min, hi))
    value, g = value * real[:, None, None], g * real[:, None]
    o = chunk_prefill_reference(C, B, value, g, None, cu_seqlens, state, state_slots)
    return (o + D.to(state.dtype)[:, None] * x.to(state.dtype) * real[:, None, None]).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# the CUDA launches, the custom ops (CPU: the references) and the engine's calls


def chunk_prefill_key(family: str, key_t, val_t) -> KernelKey:
    """The chunked prefill kernel for packed key-side (k / B: (N, Hk, K)) and value-side ((N, Hv, V)) tensors."""
    spec = SPECS[family]
    dims = linear_dims(family, key_t.shape[-2], val_t.shape[-2], key_t.shape[-1], val_t.shape[-1])
    return KernelKey(spec.family, spec.op, dims, "bfloat16")


def launch_gdn(q, k, v, g, beta, cu_seqlens, state, state_slots, *, checked=True):
    op = kernel_for(chunk_prefill_key("gdn", k, v), cu_seqlens.shape[0] - 1)
    return on_torch_stream(chunk_prefill, op, q, k, v, g, beta, cu_seqlens, state, state_slots,
                           check_values=checked and not capturing())


def launch_mamba2(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots, dt_min: float = 0.0,
                  dt_max: float | None = None, *, checked=True):
    """Mamba-2's takes the layer's raw x and dt: its front and D skip run inside the kernels."""
    op = kernel_for(chunk_prefill_key("mamba2", B, x), cu_seqlens.shape[0] - 1)
    return on_torch_stream(mamba2_chunk_prefill, op, x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state,
                           state_slots, dt_min, dt_max, check_values=checked and not capturing())


@torch.library.custom_op("kvbuffer::gdn_chunk_prefill", mutates_args=("state",), device_types="cpu")
def gdn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           cu_seqlens: torch.Tensor, state: torch.Tensor, state_slots: torch.Tensor) -> torch.Tensor:
    """chunk_prefill_reference, delta rule: q, k (N, Hk, K) normalised (q scaled), v (N, Hv, V),
    g, beta (N, Hv) -> o (N, Hv, V); each sequence's final state written to its slot (none for -1)."""
    return chunk_prefill_reference(q, k, v, g, beta, cu_seqlens, state, state_slots)


@torch.library.custom_op("kvbuffer::mamba2_chunk_prefill", mutates_args=("state",), device_types="cpu")
def mamba2_op(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
              B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, cu_seqlens: torch.Tensor,
              state: torch.Tensor, state_slots: torch.Tensor, dt_min: float = 0.0,
              dt_max: Optional[float] = None) -> torch.Tensor:
    """mamba2_chunk_prefill_reference: raw x (N, H, P), dt (N, H), B, C (N, G, N_state), A_log, dt_bias,
    D (H,) -> y (N, H, P) with the D skip, before the gate; final states written as gdn_chunk_prefill's."""
    return mamba2_chunk_prefill_reference(x, dt, A_log, dt_bias, B, C, D, cu_seqlens, state, state_slots,
                                          dt_min, dt_max)


_GDN_ARGS = ("q", "k", "v", "g", "beta", "cu_seqlens", "state", "state_slots")
implement(gdn_op, lambda a: check_shapes(*(a[n] for n in _GDN_ARGS), delta_rule=True),
          lambda a: torch.empty_like(a["v"]), launch_gdn)
implement(mamba2_op, lambda a: check_mamba2_shapes(**a), lambda a: torch.empty_like(a["x"]), launch_mamba2)
GDN_CHUNK_PREFILL_OP = EngineOp(launch_gdn, lambda: torch.ops.kvbuffer.gdn_chunk_prefill)
MAMBA2_CHUNK_PREFILL_OP = EngineOp(launch_mamba2, lambda: torch.ops.kvbuffer.mamba2_chunk_prefill)


# ----------------------------------------------------------------------------------------------
# the tuner's inputs and expected outputs, by argument name


PREFILL_TOKENS = 4096  # tokens of the tuned prefill, shared out among the batch's sequences
TOKENS = {"gdn": ("q", "k", "v", "g", "beta"), "mamba2": ("x", "dt", "A_log", "dt_bias", "B", "C", "D")}
OUTPUT = {"gdn": "o", "mamba2": "y"}


def _tuned_key(shape: Mapping, chunk_size: int, drafts: int) -> KernelKey:
    dims = linear_dims(shape["family"], shape["Hk"], shape["Hv"], shape["K"], shape["V"])
    return KernelKey(shape["family"], "chunk_prefill", dims, "bfloat16")


def _lengths(batch: int) -> list[int]:
    """About PREFILL_TOKENS // batch tokens a sequence, give or take one (at least one)."""
    per = max(2, PREFILL_TOKENS // max(batch, 1))
    return [per - 1 + i % 3 for i in range(batch)]


def _tuned_inputs(shape, batch, chunk_size, device, gen) -> dict:
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    lengths = _lengths(batch)
    N = sum(lengths)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q = (F.normalize(r(N, Hk, K), dim=-1) * K ** -0.5).bfloat16()
    k = F.normalize(r(N, Hk, K), dim=-1).bfloat16()
    g = -F.softplus(r(N, Hv)) * torch.logspace(-2.5, 0.5, Hv, device=device)  # slow to fast decay
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    state = 0.1 * r(batch, Hv, K, V)
    slots = torch.randperm(batch, generator=gen, device=gen.device).to(device=device, dtype=torch.int32)
    out = torch.empty(N, Hv, V, device=device).bfloat16()
    pools = dict(cu_seqlens=cu, state=state, state_slots=slots)
    if shape["family"] == "gdn":
        return dict(q=q, k=k, v=r(N, Hv, V).bfloat16(), g=g, beta=torch.sigmoid(r(N, Hv)), o=out, **pools)
    A_log = torch.linspace(-2.0, 1.0, Hv, device=device)  # slow to fast decay, as g above
    return dict(x=(0.3 * r(N, Hv, V)).bfloat16(), dt=r(N, Hv) - 1.0, A_log=A_log, dt_bias=0.5 * r(Hv), B=k, C=q,
                D=r(Hv), y=out, **pools)


def _tuned_reference(shape, chunk_size, args: Mapping) -> dict:
    family = shape["family"]
    tokens = [args[n].double() for n in TOKENS[family]]
    fn = chunk_prefill_reference if family == "gdn" else mamba2_chunk_prefill_reference
    state = args["state"].double()
    o = fn(*tokens, args["cu_seqlens"], state, args["state_slots"])
    return {OUTPUT[family]: o, "state": state}


def _tuned_launch(family: str):
    def launch(op, args: list) -> None:
        named = dict(zip(SPECS[family].args, args))
        fn = chunk_prefill if family == "gdn" else mamba2_chunk_prefill
        rows = [named[n] for n in ("cu_seqlens", "state", "state_slots")]
        fn(op, *(named[n] for n in TOKENS[family]), *rows, out=named[OUTPUT[family]], check_values=False)
    return launch


def variant(family: str, package: str) -> TunerVariant:
    """The chunked prefill of `family` ("gdn" or "mamba2") as the tuner builds it, from `package`'s templates."""
    of = lambda fn: lambda shape, *a, **kw: fn({**shape, "family": family}, *a, **kw)  # noqa: E731
    return TunerVariant(SPECS[family], f"{family}_chunk_prefill", family, of(_tuned_key), of(_tuned_inputs),
                        of(_tuned_reference), dict(package=package, uses_chunk=False, launch=_tuned_launch(family),
                                                   takes=lambda shape: fits(shape["K"], shape["V"])))
