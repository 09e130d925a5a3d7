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
from . import keys
from .compiled import CompiledOp
from .keys import KernelKey

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
    # untuned tunables that depend on the compile target's arch, over `defaults` (a faster form that only
    # some archs compile); see defaults_on
    target_defaults: Callable[[KernelKey, str], dict] = field(default=lambda k, arch: {}, repr=False)
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

    def defaults_on(self, key: KernelKey, arch: str) -> dict:
        """The untuned tunables of `key` when compiled for `arch` (e.g. "sm_90a")."""
        return {**self.defaults(key), **self.target_defaults(key, arch)}

    def launch_params(self, key: KernelKey, tunables: dict) -> dict:
        return dict(self.complete_tunables(key, tunables), **self.params(key))

    def build(self, key: KernelKey, tunables: dict | None = None) -> CompiledOp:
        """Compile `key` for the local GPU into a CompiledOp: its defaults for that GPU's arch, with
        `tunables` (some or all) over them."""
        target = local_target()  # before TileLang loads: an unsupported GPU fails fast with DeviceError
        arch = target["arch"]
        tunables = self.defaults_on(key, arch) if tunables is None else {**self.target_defaults(key, arch),
                                                                          **tunables}
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
          "FP8_GEMV": ("gemv", "fp8_gemv"), "FP8_QUANT_ACT": ("gemv", "fp8_quant"),
          **{f"{f.upper()}_{op.upper()}": (f, op) for f in ("gdn", "mamba2")
             for op in ("recurrent", "buffered", "flush", "recurrent_drafts", "chunk_prefill")}}


def __getattr__(name: str) -> KernelSpec:
    if name in _MOVED:
        return SPECS[_MOVED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
