"""What the tuner builds, checks and times: a `Template`, one tuned variant of a kernel.

    build(shape, chunk_size, *, target, drafts, **tunables) -> a compiled TileLang kernel
    configs() -> the tunables worth trying; defaults(shape, drafts) -> the untuned ones
    make_inputs(shape, batch, chunk_size, device, gen, drafts) -> {argument name: value}
    reference(shape, chunk_size, {argument name: value}) -> {argument name: expected value after the run}
    args: the kernel's argument names, in the order it takes them

`from_spec` makes one from a kernel's KernelSpec (kvbuffer.kernels.specs) and the key a (shape, chunk
size, drafts) names, so the tuner compiles through the spec as the JIT does. A kernel of several
launches (`parts`, the chunked prefill) is built as one CompiledOp, checked and timed as one, and stored
as one artifact per launch (`stored_as`). `shape` is a tuning
record's shape dict. Layout-dependent templates (`layouts=True`) are built per draft count T
(buffers of C + T + 1 entries); `min_drafts=1` marks kernels only speculative decoding launches.
TileLang and torch are imported only inside the callables.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from kvbuffer.artifacts import templates_digest
from kvbuffer.kernels.compiled import CompiledOp
from kvbuffer.kernels.keys import KernelKey
from kvbuffer.kernels.linear import capacity  # noqa: F401  (re-exported: the tuner's layouts)
from kvbuffer.kernels.specs import TILES, KernelSpec



@dataclass(frozen=True)
class Template:
    name: str
    family: str                                  # the tuning record's family
    build: Callable[..., Any] = field(repr=False)
    configs: Callable[[], list] = field(repr=False)
    defaults: Callable[[Mapping, int, str | None], dict] = field(repr=False)  # (shape, drafts, arch or None)
    make_inputs: Callable[..., dict] = field(repr=False)
    reference: Callable[..., dict] = field(repr=False)
    args: tuple[str, ...]
    source: str = ""          # sha256 of the templates' sources: part of the artifact key
    uses_chunk: bool = True   # False: one kernel serves every chunk size (stored with chunk_size 0)
    tolerance: float = 2e-2   # relative error (vs the reference) a variant may have
    min_chunk: int = 1        # smallest chunk size the kernel makes sense for (a T-token chunk needs C >= T)
    layouts: bool = False     # build / make_inputs take drafts=T (buffers of C + T + 1 entries)
    min_drafts: int = 0       # 1: only speculative decoding launches it (the verify)
    # a kernel of several launches (build gives a CompiledOp whose fn maps part names to compiled functions):
    # its parts for a shape, each stored as its own artifact under `<name>_<part>`; and how it runs
    parts: Callable[[Mapping], tuple] | None = field(default=None, repr=False)
    launch: Callable[[Any, list], None] | None = field(default=None, repr=False)
    # the TileLang prim_func(s) `build` would compile, traced without compiling (None: not known)
    trace: Callable[..., Any] | None = field(default=None, repr=False)
    # whether the template takes a shape (head dims it cannot tile): the tuner's plan skips those it does not
    takes: Callable[[Mapping], bool] = field(default=lambda shape: True, repr=False)

    def defaults_for(self, shape: Mapping, drafts: int = 0, arch: str | None = None) -> dict:
        """The untuned tunables for one shape and buffer layout (compiled for `arch`, where given)."""
        return dict(self.defaults(shape, drafts, arch))

    def drafts_for(self, draft_tokens) -> list[int]:
        """The buffer layouts (draft counts) to build this kernel for: 0 alone unless it depends on them."""
        if not self.layouts:
            return [0]
        return [d for d in sorted(set(draft_tokens)) if d >= self.min_drafts]

    def check(self, shape: Mapping, chunk_size: int, drafts: int = 0, traced: bool = True) -> None:
        """Raise the error building this kernel with its defaults would raise (a head size the template
        does not take), without compiling: its defaults always, its TileLang trace when `traced` (a
        fraction of a second; the compile takes seconds)."""
        tunables = self.defaults_for(shape, drafts)
        if traced and self.trace is not None:
            self.trace(dict(shape), chunk_size, **self._layout(drafts), **tunables)

    def compile(self, shape: Mapping, chunk_size: int, drafts: int, *, target, **tunables):
        return self.build(dict(shape), chunk_size, target=target, **self._layout(drafts), **tunables)

    def inputs(self, shape: Mapping, batch: int, chunk_size: int, device, gen, drafts: int = 0) -> list:
        """The kernel's arguments in its order (make_inputs names each of `args`, no other)."""
        named = self.make_inputs(dict(shape), batch, chunk_size, device, gen, **self._layout(drafts))
        if set(named) != set(self.args):
            raise TypeError(f"{self.name}: make_inputs must name exactly {self.args}, got {tuple(named)}")
        return [named[n] for n in self.args]

    def named(self, args: list) -> dict:
        """Arguments in the kernel's order, by name."""
        return dict(zip(self.args, args))

    def run(self, kernel, args: list) -> None:
        if self.launch is not None:
            self.launch(kernel, args)
        else:
            kernel(*args)

    def stored_as(self, shape: Mapping) -> dict:
        """{part: the name its artifact and tuning-record winner go by}: {None: name} for one launch."""
        return {None: self.name} if self.parts is None else {p: f"{self.name}_{p}" for p in self.parts(shape)}

    def _layout(self, drafts: int) -> dict:
        if drafts and not self.layouts:
            raise ValueError(f"{self.name} does not depend on the buffer layout; build it with drafts=0")
        return {"drafts": drafts} if self.layouts else {}


def from_spec(spec: KernelSpec, name: str, family: str, key: Callable[[Mapping, int, int], KernelKey],
              make_inputs: Callable[..., dict], reference: Callable[..., dict], *, package: str = TILES,
              configs: Callable[[], list] | None = None, **fields) -> Template:
    """A template that compiles `spec` for the key `key(shape, chunk_size, drafts)` names, from `package`'s
    templates (another revision's, for an A/B run); its defaults are the spec's for that key."""
    def build(shape, chunk_size, *, target, drafts=0, **tunables):
        k = key(shape, chunk_size, drafts)
        prim = spec.prim(k, tunables, package)
        compile_template = importlib.import_module(TILES).compile_template
        if spec.parts is None:
            return compile_template(prim, target)
        return CompiledOp({p: compile_template(f, target) for p, f in prim.items()}, spec.kind,
                          spec.launch_params(k, tunables))

    def trace(shape, chunk_size, *, drafts=0, **tunables):
        return spec.prim(key(shape, chunk_size, drafts), tunables, package)

    def defaults(shape, drafts, arch=None):
        k = key(shape, fields.get("min_chunk", 1), drafts)
        return spec.defaults(k) if arch is None else spec.defaults_on(k, arch)

    if spec.parts is not None:
        fields.setdefault("parts", lambda shape: spec.parts(key(shape, fields.get("min_chunk", 1), 0)))
    return Template(name, family, build, configs or spec.configs, defaults, make_inputs, reference, spec.args,
                    templates_digest(), trace=trace, **fields)

