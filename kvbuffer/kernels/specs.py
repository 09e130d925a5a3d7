"""One `KernelSpec` per compiled kernel: everything the JIT, the first-use build and `kvbuffer tune` need.

A spec owns its key fields (family, op), its TileLang template (a function of kvbuffer.tiles, imported
on first use: the runtime never imports TileLang), the template's keywords for a KernelKey, the
untuned and tunable configurations, the parameters its launcher validates, its arguments by name,
its reference and the torch custom ops that launch it. `spec_for(key)` finds it; every build goes
through `KernelSpec.build` / `KernelSpec.prim`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..gpus import local_target
from ..reference import conv as ref_conv
from ..reference import core as ref_core
from ..reference import experts as ref_experts
from ..reference import fp8 as ref_fp8
from ..reference import gdn as ref_gdn
from ..reference import mamba2 as ref_mamba2
from .compiled import CompiledOp
from ..tuning import make_conv_shape
from .keys import ATTENTION_MAX_TOKENS, PREFILL_CHUNKS, KernelKey, attention_shape, projection_shape

TILES = "kvbuffer.tiles"
MODEL_TUNE = "kvbuffer tune --gpu <gpu> --model <model>"


@dataclass(frozen=True)
class KernelSpec:
    name: str                                   # the template: kvbuffer.tiles.<module>.<name>
    module: str
    family: str                                 # KernelKey.family
    op: str                                     # KernelKey.op
    kind: str                                   # CompiledOp.kind its launcher expects
    template_args: Callable[[KernelKey], dict] = field(repr=False)  # its keywords for a key, tunables apart
    defaults: Callable[[KernelKey], dict] = field(repr=False)       # untuned tunables for a key
    configs: Callable[[], list] = field(repr=False)                 # tunables worth measuring
    params: Callable[[KernelKey], dict] = field(repr=False)         # what the launcher checks, tunables apart
    args: tuple[str, ...] = ()                  # the compiled kernel's arguments, in order
    reference: Callable[..., Any] | None = field(default=None, repr=False)  # the same math in torch
    custom_ops: tuple[str, ...] = ()            # torch.ops.kvbuffer.* whose CUDA call launches it
    # where `kvbuffer tune` stores it: the buffer layouts (C or None, drafts) a key fits, the tune
    # template that builds it (None: tune builds no such variant), the record shapes that can hold it
    # and the command that builds it (`<gpu>` left for the caller)
    layouts: Callable[[KernelKey], list] = field(default=lambda k: [(None, 0)], repr=False)
    tune_template: Callable[[KernelKey], str | None] = field(default=lambda k: None, repr=False)
    record_shapes: Callable[[KernelKey], list] = field(default=lambda k: [], repr=False)
    tune_command: Callable[[KernelKey], str] = field(default=lambda k: MODEL_TUNE, repr=False)
    # a partial set of tunables completed for a key (defaults filled in, tiles fitted to the head)
    complete_tunables: Callable[[KernelKey, dict], dict] = field(default=lambda k, t: dict(t), repr=False)
    # a kernel of several launches: its parts' names for a key, and (the template module, key, complete
    # tunables) -> {part: prim_func}; its CompiledOp's fn maps the names to the compiled functions, and
    # `kvbuffer tune` stores each part as the template `<tune_template>_<part>`
    parts: Callable[[KernelKey], tuple] | None = field(default=None, repr=False)
    part_templates: Callable[..., dict] | None = field(default=None, repr=False)

    def template(self, package: str = TILES) -> Callable:
        """The template function (imported now: the runtime calls this only to compile)."""
        return getattr(importlib.import_module(f"{package}.{self.module}"), self.name)

    def prim(self, key: KernelKey, tunables: dict, package: str = TILES):
        """The TileLang prim_func of `key` with `tunables` (from `package`'s copy of the templates); for a
        kernel of several launches, {part: prim_func}."""
        tunables = self.complete_tunables(key, tunables)
        if self.parts is not None:
            return self.part_templates(importlib.import_module(f"{package}.{self.module}"), key, tunables)
        return self.template(package)(**self.template_args(key), **tunables)

    def launch_params(self, key: KernelKey, tunables: dict) -> dict:
        return dict(self.complete_tunables(key, tunables), **self.params(key))

    def build(self, key: KernelKey, tunables: dict | None = None) -> CompiledOp:
        """Compile `key` for the local GPU (its defaults unless `tunables`) into a CompiledOp."""
        target = local_target()  # before TileLang loads: an unsupported GPU fails fast with DeviceError
        tunables = self.defaults(key) if tunables is None else dict(tunables)
        compile_template = importlib.import_module(TILES).compile_template
        prim = self.prim(key, tunables)
        fn = {part: compile_template(p, target) for part, p in prim.items()} if self.parts else \
            compile_template(prim, target)
        return CompiledOp(fn, self.kind, self.launch_params(key, tunables))


# ----------------------------------------------------------------------------------------------
# the linear families (GDN, Mamba-2): one template each per op, keys in the generic Hk, Hv, K, V


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


def _configs(module: str, name: str) -> Callable[[], list]:
    return lambda: getattr(importlib.import_module(f"{TILES}.{module}"), name)()


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


def _linear_shapes(key: KernelKey) -> list:
    return [{"family": key.family, **key.dims.record_fields(), "dtype": key.dtype}]  # tuning.make_shape's form


def _model_command(layouts: Callable[[KernelKey], list]) -> Callable[[KernelKey], str]:
    """The conv's, attention's and the projections' tune command: their shapes come from the model."""
    def command(key: KernelKey) -> str:
        drafts = layouts(key)[0][1]
        return MODEL_TUNE + (f" --draft-tokens {drafts}" if drafts > 0 else "")
    return command


def _linear_specs(family: str, front: tuple, out: str, reference) -> list[KernelSpec]:
    common = dict(module=family, family=family, params=_linear_params, layouts=_linear_layouts,
                  tune_template=_linear_template, record_shapes=_linear_shapes, tune_command=_linear_command)
    return [
        KernelSpec(f"{family}_recurrent", op="recurrent", kind="recurrent",
                   template_args=lambda k: dict(_head_args(k), in_dtype=k.in_dtype, **_with_z(k)),
                   defaults=_value_tile, configs=_configs(family, "get_recurrent_configs"),
                   args=front + STATE + (out,), reference=reference.recurrent_step,
                   custom_ops=(f"{family}_recurrent_step",), **common),
        KernelSpec(f"{family}_buffered", op="buffered", kind="buffered",
                   template_args=lambda k: dict(_head_args(k), cap=k.cap, T_new=k.T, flush_at=k.C,
                                                in_dtype=k.in_dtype, buf_dtype=k.buf_dtype, **_with_z(k)),
                   defaults=_buffered_defaults, configs=_configs(family, "get_buffered_configs"),
                   args=front + STATE + BUFFER + (out,), reference=reference.verify,
                   custom_ops=(f"{family}_buffered_step", f"{family}_verify"), **common),
        KernelSpec(f"{family}_flush", op="flush", kind="flush",
                   template_args=lambda k: dict(_head_args(k), cap=k.cap, buf_dtype=k.buf_dtype),
                   defaults=_value_tile, configs=_configs(family, "get_flush_configs"),
                   args=STATE + BUFFER, reference=ref_core.flush, custom_ops=(f"{family}_flush",), **common),
        KernelSpec(f"{family}_recurrent_drafts", op="recurrent_drafts", kind="recurrent_drafts",
                   template_args=lambda k: dict(_head_args(k), T_new=k.T, in_dtype=k.in_dtype, **_with_z(k)),
                   defaults=_drafts_defaults, configs=_configs(family, "get_recurrent_configs"),
                   args=front + STATE + DRAFTS + (out,), reference=reference.recurrent_drafts,
                   custom_ops=(f"{family}_recurrent_drafts",), **common),
    ]


# ----------------------------------------------------------------------------------------------
# the chunked prefill of packed prompts (tiles/gdn_prefill.py): four launches, three decay-only (Mamba-2's,
# from the layer's raw x, dt and parameters: kvbuffer.kernels.prefill.mamba2_chunk_prefill)


PREFILL_TUNABLES = ("states_BV", "states_stages", "output_BV", "threads", "prep_solve")
_PREFILL_DEFAULTS = {"states_stages": 0, "threads": 128, "prep_solve": "substitution"}  # where a config names none


def prefill_tunables(key: KernelKey, given: dict | None = None) -> dict:
    """The chunked prefill's tunables for `key`: its defaults (the templates' first config over
    _PREFILL_DEFAULTS) with `given` over them, each value tile capped at the head's V and halved until it divides V.
    Unknown names are a TypeError."""
    unknown = set(given or {}) - set(PREFILL_TUNABLES)
    if unknown:
        raise TypeError(f"unknown chunked prefill tunables {sorted(unknown)}; they are {PREFILL_TUNABLES}")
    t = dict(given or {})
    if set(PREFILL_TUNABLES) - set(t):  # an artifact's are complete: the run time imports no template here
        t = {**_PREFILL_DEFAULTS, **importlib.import_module(f"{TILES}.gdn_prefill").configs()[0], **t}
    V = key.dims.record_fields()["V"]
    return dict(t, states_BV=_dividing_tile(t["states_BV"], V), output_BV=_dividing_tile(t["output_BV"], V))


def _dividing_tile(BV: int, V: int) -> int:
    """BV, halved until it divides V (V a multiple of 16, so 16 always does)."""
    BV = min(BV, V)
    while V % BV and BV > 16:
        BV //= 2
    return BV


def _prefill_configs(family: str) -> Callable[[], list]:
    """The templates' configs, each complete (so a tuned artifact's tunables are); the decay-only form has
    no pipelined state pass and no prep (so no prep solve)."""
    def configs() -> list:
        found = [{**_PREFILL_DEFAULTS, **c} for c in importlib.import_module(f"{TILES}.gdn_prefill").configs()]
        return [c for c in found if family == "gdn" or (not c["states_stages"]
                                                         and c["prep_solve"] == _PREFILL_DEFAULTS["prep_solve"])]
    return configs


def _prefill_parts(key: KernelKey) -> tuple:
    return ("chunks", "prep", "states", "output") if key.family == "gdn" else ("chunks", "states", "output")


def _prefill_templates(tiles, key: KernelKey, t: dict) -> dict:
    """The launches of one chunked prefill: the chunk table, GDN's prep, the state pass, the output."""
    dims = key.dims.record_fields()
    delta_rule = key.family == "gdn"
    prims = {"chunks": tiles.gdn_prefill_chunks(threads=t["threads"])}
    if delta_rule:
        prims["prep"] = tiles.gdn_prefill_prep(**dims, threads=t["threads"], solve=t["prep_solve"])
    prims["states"] = tiles.gdn_prefill_states(**dims, BV=t["states_BV"], threads=t["threads"],
                                               stages=t["states_stages"], delta_rule=delta_rule)
    prims["output"] = tiles.gdn_prefill_output(**dims, BV=t["output_BV"], threads=t["threads"], delta_rule=delta_rule)
    return prims


def _prefill_args(key: KernelKey) -> dict:
    return dict(key.dims.record_fields(), delta_rule=key.family == "gdn")


def _prefill_shapes(key: KernelKey) -> list:
    """Its kernels run bf16 whatever the model's activations, so a bf16 or an fp16 record can hold them."""
    return [dict(_linear_shapes(key)[0], dtype=dtype) for dtype in ("bfloat16", "float16")]


def _prefill_command(key: KernelKey) -> str:
    heads = ",".join(str(n) for n in key.dims.record_fields().values())
    return f"kvbuffer tune --gpu <gpu> --heads {heads}" + (f" --family {key.family}" if key.family != "gdn" else "")


def _prefill_spec(family: str, args: tuple) -> KernelSpec:
    """Its reference is the CPU op's (kvbuffer.kernels.prefill.chunk_prefill_reference); `kvbuffer tune`
    stores it as one artifact per launch, one layout for every chunk size."""
    return KernelSpec(f"{family}_chunk_prefill", "gdn_prefill", family, "chunk_prefill", "chunk_prefill",
                      template_args=_prefill_args, defaults=prefill_tunables, configs=_prefill_configs(family),
                      params=_prefill_args, args=args, custom_ops=(f"{family}_chunk_prefill",),
                      tune_template=lambda k: f"{k.family}_chunk_prefill", record_shapes=_prefill_shapes,
                      tune_command=_prefill_command, complete_tunables=prefill_tunables, parts=_prefill_parts,
                      part_templates=_prefill_templates)


GDN_CHUNK_PREFILL = _prefill_spec("gdn", ("q", "k", "v", "g", "beta", "cu_seqlens", "state", "state_slots", "o"))
MAMBA2_CHUNK_PREFILL = _prefill_spec("mamba2", ("x", "dt", "A_log", "dt_bias", "B", "C", "D", "cu_seqlens", "state",
                                                "state_slots", "y"))  # its front and D skip inside


# ----------------------------------------------------------------------------------------------
# the short conv, decode attention, the projections


def _conv_update_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, T_len=k.T, mode=k.op, dtype=k.in_dtype, w_dtype=k.w_dtype or k.in_dtype,
                has_bias=k.has_bias, silu=k.silu)


def _conv_accept_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(D=d.D, W=d.W, span=d.span, dtype=k.in_dtype)


def _conv_threads() -> list[dict]:
    return [{"threads": t} for t in (128, 256, 64)]


def _conv_layouts(key: KernelKey) -> list:
    """The drafts the pool's span makes room for; every C."""
    return [(None, key.dims.span - key.dims.W)]


def _conv_template(key: KernelKey) -> str | None:
    """With SiLU: the step, the any-length prompt, the verify of all drafts + 1 and the accept."""
    drafts = key.dims.span - key.dims.W
    if drafts < 0 or not key.silu:
        return None
    if key.op == "accept":
        return "conv1d_accept" if drafts >= 1 else None
    if key.op == "verify":
        return "conv1d_verify" if drafts >= 1 and key.T == drafts + 1 else None
    return {1: "conv1d_step", 0: "conv1d_prefill"}.get(key.T)


def _conv_shapes(key: KernelKey) -> list:
    """The accept reads no weights, so it is found in a record of any weight dtype and bias."""
    D, W = key.dims.D, key.dims.W
    if key.op != "accept":
        return [make_conv_shape(D, W, key.in_dtype, key.w_dtype, key.has_bias)]
    w_dtypes = dict.fromkeys((key.in_dtype, "bfloat16", "float16", "float32"))
    return [make_conv_shape(D, W, key.in_dtype, w, bias) for bias in (False, True) for w in w_dtypes]


CONV_RECORDS = dict(layouts=_conv_layouts, tune_template=_conv_template, record_shapes=_conv_shapes,
                    tune_command=_model_command(_conv_layouts))


def _conv_update(op: str, reference) -> KernelSpec:
    return KernelSpec("conv1d_update", "conv1d", "conv1d", op, f"conv_{op}", template_args=_conv_update_args,
                      defaults=lambda k: {"threads": 128}, configs=_conv_threads,
                      params=lambda k: dict(_conv_update_args(k), T=k.T),
                      args=("x", "conv_state", "slots", "weight", "bias", "out"), reference=reference,
                      custom_ops=("conv1d_update",), **CONV_RECORDS)


CONV_SPECS = [
    _conv_update("advance", ref_conv.step_rows),
    _conv_update("verify", ref_conv.verify_rows),
    KernelSpec("conv1d_accept", "conv1d", "conv1d", "accept", "conv_accept", template_args=_conv_accept_args,
               defaults=lambda k: {"threads": 128}, configs=_conv_threads, params=_conv_accept_args,
               args=("conv_state", "slots", "accepted"), reference=ref_conv.accept_rows,
               custom_ops=("conv1d_accept",), **CONV_RECORDS),
]


def _decode_args(k: KernelKey) -> dict:
    d = k.dims
    return dict(H=d.H, Hkv=d.Hkv, D=d.D, T_len=k.T, dtype=k.in_dtype, kv_dtype=k.buf_dtype)


def _combine_args(k: KernelKey) -> dict:
    return dict(H=k.dims.H, D=k.dims.D, T_len=k.T, dtype=k.in_dtype)


def _attention_layouts(key: KernelKey) -> list:
    return [(None, key.T - 1)]


def _attention_template(key: KernelKey) -> str | None:
    """The decode step (T = 1) and the verify of T - 1 drafts + 1, each with its combine."""
    if not 1 <= key.T <= ATTENTION_MAX_TOKENS:
        return None
    return f"attention_{key.op}" + ("_verify" if key.T > 1 else "")


def _attention_shapes(key: KernelKey) -> list:
    return [attention_shape(key.dims.H, key.dims.Hkv, key.dims.D, key.in_dtype, key.buf_dtype)]


ATTENTION_RECORDS = dict(layouts=_attention_layouts, tune_template=_attention_template,
                         record_shapes=_attention_shapes, tune_command=_model_command(_attention_layouts))

# their reference is kvbuffer.kernels.attention.attention_reference (the CPU op's), which builds on this module
ATTENTION_SPECS = [
    KernelSpec("attention_decode", "attention", "attention", "decode", "attention_decode",
               template_args=_decode_args, defaults=lambda k: {"threads": 128, "unroll": 4},
               configs=_configs("attention", "get_configs"), params=lambda k: dict(_decode_args(k), T=k.T),
               args=("q", "k_cache", "v_cache", "slots", "cached", "part", "stats", "out", "scale"),
               custom_ops=("attention_decode",), **ATTENTION_RECORDS),
    KernelSpec("attention_combine", "attention", "attention", "combine", "attention_combine",
               template_args=_combine_args, defaults=lambda k: {"threads": 128},
               configs=lambda: [{"threads": t} for t in (128, 256)], params=lambda k: dict(_combine_args(k), T=k.T),
               args=("part", "stats", "slots", "out"), custom_ops=("attention_decode",), **ATTENTION_RECORDS),
]


def _module_default(module: str, name: str = "DEFAULT") -> Callable[[KernelKey], dict]:
    return lambda k: dict(getattr(importlib.import_module(f"{TILES}.{module}"), name))


def _projection_args(k: KernelKey) -> dict:
    return dict(N=k.dims.N, K=k.dims.K, dtype=k.in_dtype)


def _rows_args(k: KernelKey) -> dict:
    return dict(_projection_args(k), rows=k.T)


def _linear(x, weight):
    """The one-row kernel's math: F.linear without a bias."""
    return x @ weight.T


def _experts(x, weight, expert):
    """Each row through each of its experts' weights: (S, J, N)."""
    return (weight[expert] @ x[:, None, :, None])[..., 0]


def _fp8_args(k: KernelKey) -> dict:
    return dict(_rows_args(k), bn=k.dims.bn, bk=k.dims.bk)


def _fp8_linear(x, q, scale, bn: int, bk: int):
    """The FP8 one-row kernel's math: x . (q * scale)^T in fp32, in x's dtype."""
    return ref_fp8.linear(x, q, scale, (bn, bk))


def _projection_records(name: str) -> dict:
    """A projection fits every layout; tune builds it for one row, stored under its op's record family
    (with an FP8 weight's scale block)."""
    return dict(tune_template=lambda k: name if k.T == 1 else None,
                record_shapes=lambda k: [projection_shape(k.op, k.dims.N, k.dims.K, k.in_dtype,
                                                          k.dims.block if k.dims.bn else None)],
                tune_command=_model_command(lambda k: [(None, 0)]))


def _quant_args(k: KernelKey) -> dict:
    return dict(K=k.dims.K, dtype=k.in_dtype)


GEMV_SPECS = [
    KernelSpec("gemv", "gemv", "gemv", "gemv", "gemv", template_args=_rows_args, defaults=_module_default("gemv"),
               configs=_configs("gemv", "get_configs"), params=_rows_args, args=("x", "weight", "out"),
               reference=_linear, custom_ops=("gemv",), **_projection_records("gemv")),
    KernelSpec("gemv_experts", "gemv", "gemv", "experts", "gemv_experts", template_args=_projection_args,
               defaults=_module_default("gemv"), configs=_configs("gemv", "get_configs"), params=_projection_args,
               args=("x", "weight", "expert", "out"), reference=_experts, custom_ops=("gemv_experts",),
               **_projection_records("gemv_experts")),
    KernelSpec("grouped_experts", "grouped", "gemv", "grouped", "grouped_experts", template_args=_projection_args,
               defaults=_module_default("grouped"), configs=_configs("grouped", "get_configs"),
               params=_projection_args, args=("x", "weight", "ends", "out"), reference=ref_experts.grouped_matmul,
               custom_ops=("grouped_experts",), **_projection_records("grouped_experts")),
    KernelSpec("fp8_gemv", "gemv", "gemv", "fp8_gemv", "fp8_gemv", template_args=_fp8_args,
               defaults=_module_default("gemv", "FP8_DEFAULT"), configs=_configs("gemv", "get_fp8_configs"),
               params=_fp8_args, args=("x", "q", "scale", "out"), reference=_fp8_linear, custom_ops=("fp8_gemv",),
               **_projection_records("fp8_gemv")),
    KernelSpec("fp8_quant_act", "fp8_quant", "gemv", "fp8_quant", "fp8_quant_act", template_args=_quant_args,
               defaults=_module_default("fp8_quant"), configs=_configs("fp8_quant", "get_configs"),
               params=_quant_args, args=("x", "q", "scale"), reference=ref_fp8.quantize_activations_padded,
               custom_ops=("fp8_quant_act",), **_projection_records("fp8_quant_act")),
]

GDN_SPECS = _linear_specs("gdn", GDN_FRONT, "o", ref_gdn)
MAMBA2_SPECS = _linear_specs("mamba2", MAMBA2_FRONT, "y", ref_mamba2)
GDN_RECURRENT, GDN_BUFFERED, GDN_FLUSH, GDN_RECURRENT_DRAFTS = GDN_SPECS
MAMBA2_RECURRENT, MAMBA2_BUFFERED, MAMBA2_FLUSH, MAMBA2_RECURRENT_DRAFTS = MAMBA2_SPECS
CONV_ADVANCE, CONV_VERIFY, CONV_ACCEPT = CONV_SPECS
ATTENTION_DECODE, ATTENTION_COMBINE = ATTENTION_SPECS
GEMV, GEMV_EXPERTS, GROUPED_EXPERTS, FP8_GEMV, FP8_QUANT_ACT = GEMV_SPECS
PREFILL_SPECS = [GDN_CHUNK_PREFILL, MAMBA2_CHUNK_PREFILL]
SPECS = {(s.family, s.op): s for s in GDN_SPECS + MAMBA2_SPECS + PREFILL_SPECS + CONV_SPECS + ATTENTION_SPECS
         + GEMV_SPECS}


def spec_for(key: KernelKey) -> KernelSpec:
    """The spec of the kernel `key` names."""
    return SPECS[(key.family, key.op)]


def layouts(key: KernelKey) -> list[tuple[int | None, int]]:
    """The (chunk size C or None: any, drafts) buffer layouts, C + drafts + 1 entries, `key` fits."""
    return spec_for(key).layouts(key)


def tune_template(key: KernelKey) -> str | None:
    """The `kvbuffer tune` template that builds `key`, or None if tune builds no such variant."""
    return spec_for(key).tune_template(key)


def record_shapes(key: KernelKey) -> list[dict]:
    """The tuning record shapes that can hold `key`."""
    return spec_for(key).record_shapes(key)


def tune_command(key: KernelKey) -> str:
    """The `kvbuffer tune` command that builds `key` (`<gpu>` left for the caller)."""
    return spec_for(key).tune_command(key)
