"""One `KernelSpec` per compiled kernel, and the registry of kernel families that own them.

A spec owns its key fields (family, op), its TileLang template (a function of kvbuffer.tiles, imported
on first use: the runtime never imports TileLang), the template's keywords for a KernelKey, the
untuned and tunable configurations, the parameters its launcher validates, its arguments by name,
its reference and the torch custom ops that launch it. A kernel family is one module of
kvbuffer.kernels that defines its specs, custom ops, launches and tuner inputs and ends with
`register(Family(...))`; `spec_for(key)` finds a spec, every build goes through `KernelSpec.build` /
`KernelSpec.prim`.
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
from . import keys
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


@dataclass(frozen=True)
class TunerVariant:
    """One tuned variant of a spec as `kvbuffer tune` builds it (kvbuffer.autotune.template.from_spec makes
    the Template): its name, tuning-record family, the key a (shape, chunk size, drafts) names, its inputs
    and expected outputs by argument name, and from_spec's other fields (uses_chunk, layouts, ...)."""

    spec: KernelSpec
    name: str
    family: str
    key: Callable[..., KernelKey] = field(repr=False)
    make_inputs: Callable[..., dict] = field(repr=False)
    reference: Callable[..., dict] = field(repr=False)
    options: dict = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Family:
    """A kernel family as its module registers it: the KernelKey family name, its dims type and op names
    (what KernelKey accepts), its specs, the custom ops it defines ({op name: its CUDA launch, which takes
    checked=}) and its tuner variants (`package`: the kvbuffer.tiles copy they build from)."""

    name: str
    dims: type
    ops: tuple[str, ...]
    specs: tuple[KernelSpec, ...]
    launches: dict = field(default_factory=dict, repr=False)
    tuner: Callable[[str], list] = field(default=lambda package: [], repr=False)


FAMILIES: list[Family] = []                   # in registration order (kvbuffer.kernels imports them)
SPECS: dict[tuple[str, str], KernelSpec] = {}  # (family, op) -> its spec
CUDA_LAUNCHES: dict[str, Callable] = {}         # custom op name -> the CUDA implementation of torch.ops.kvbuffer.<name>


def register(family: Family) -> Family:
    """Add a family's specs, key dims and op names and custom ops' launches to the registry, once.

    KernelKey validates a key's dims and op against the tables of kvbuffer.kernels.keys; a new family's
    entries are added to them here (keys.py's text is part of every artifact key, so it is not edited
    for a family), an existing family's must match them."""
    if any(f.name == family.name and f.ops == family.ops for f in FAMILIES):
        raise ValueError(f"kernel family {family.name!r} ({family.ops}) is registered already")
    dims, ops = keys._DIMS.setdefault(family.name, family.dims), keys._OPS.get(family.name, ())
    if dims is not family.dims:
        raise TypeError(f"family {family.name!r} has dims {dims.__name__}, not {family.dims.__name__}")
    keys._OPS[family.name] = ops + tuple(op for op in family.ops if op not in ops)
    for spec in family.specs:
        if spec.family != family.name or spec.op not in family.ops or (spec.family, spec.op) in SPECS:
            raise ValueError(f"spec {spec.name} ({spec.family}, {spec.op}) does not belong to family "
                             f"{family.name!r} or is registered already")
        SPECS[(spec.family, spec.op)] = spec
    CUDA_LAUNCHES.update(family.launches)
    FAMILIES.append(family)
    return family


def tuner_variants(package: str = TILES) -> list[TunerVariant]:
    """Every registered family's tuner variants, built from `package`'s templates."""
    return [v for f in FAMILIES for v in f.tuner(package)]


def configs_of(module: str, name: str) -> Callable[[], list]:
    """A template module's config function (kvbuffer.tiles.<module>.<name>), imported when called."""
    return lambda: getattr(importlib.import_module(f"{TILES}.{module}"), name)()


def module_default(module: str, name: str = "DEFAULT") -> Callable[[KernelKey], dict]:
    """A template module's untuned tunables (kvbuffer.tiles.<module>.<name>), read when called."""
    return lambda k: dict(getattr(importlib.import_module(f"{TILES}.{module}"), name))


def model_command(layouts: Callable[[KernelKey], list]) -> Callable[[KernelKey], str]:
    """The tune command of the kernels whose shapes come from the model (conv, attention, projections)."""
    def command(key: KernelKey) -> str:
        drafts = layouts(key)[0][1]
        return MODEL_TUNE + (f" --draft-tokens {drafts}" if drafts > 0 else "")
    return command


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


def _linear_specs(family: str, front: tuple, out: str, reference) -> list[KernelSpec]:
    common = dict(module=family, family=family, params=_linear_params, layouts=_linear_layouts,
                  tune_template=_linear_template, record_shapes=_linear_shapes, tune_command=_linear_command)
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


GDN_SPECS = _linear_specs("gdn", GDN_FRONT, "o", ref_gdn)
MAMBA2_SPECS = _linear_specs("mamba2", MAMBA2_FRONT, "y", ref_mamba2)
GDN_RECURRENT, GDN_BUFFERED, GDN_FLUSH, GDN_RECURRENT_DRAFTS = GDN_SPECS
MAMBA2_RECURRENT, MAMBA2_BUFFERED, MAMBA2_FLUSH, MAMBA2_RECURRENT_DRAFTS = MAMBA2_SPECS
PREFILL_SPECS = [GDN_CHUNK_PREFILL, MAMBA2_CHUNK_PREFILL]
for _name, _dims, _ops, _specs in (("gdn", keys.GDNDims, keys.LINEAR_OPS, GDN_SPECS + [GDN_CHUNK_PREFILL]),
                                   ("mamba2", keys.Mamba2Dims, keys.LINEAR_OPS, MAMBA2_SPECS + [MAMBA2_CHUNK_PREFILL])):
    register(Family(_name, _dims, _ops, tuple(_specs)))


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


# the specs of the families that moved to their own modules, by their names here before
_MOVED = {"CONV_ADVANCE": ("conv1d", "advance"), "CONV_VERIFY": ("conv1d", "verify"), "CONV_ACCEPT": ("conv1d", "accept"),
          "ATTENTION_DECODE": ("attention", "decode"), "ATTENTION_COMBINE": ("attention", "combine"),
          "GEMV": ("gemv", "gemv"), "GEMV_EXPERTS": ("gemv", "experts"), "GROUPED_EXPERTS": ("gemv", "grouped"),
          "FP8_GEMV": ("gemv", "fp8_gemv"), "FP8_QUANT_ACT": ("gemv", "fp8_quant")}


def __getattr__(name: str) -> KernelSpec:
    if name in _MOVED:
        return SPECS[_MOVED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
