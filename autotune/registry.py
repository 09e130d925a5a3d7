"""Every tuner template `kvbuffer tune` knows, by record family ("gdn", "mamba2", "conv1d", "attention",
"gemv", "experts", "grouped", "fp8_gemv", "fp8_quant"); each is built from its kernel's KernelSpec
(kvbuffer.autotune.template), the registered kernel families' from the tuner variants their modules
define (kvbuffer.kernels.specs.tuner_variants)."""

from __future__ import annotations

import importlib.util

from kvbuffer.kernels import specs

from .template import Template, capacity, from_spec

__all__ = ["Template", "capacity", "family_templates", "gdn_templates", "mamba2_templates", "templates"]


def family_templates(package: str = specs.TILES) -> list[Template]:
    """The registered families' templates whose kernel templates `package` holds."""
    return [from_spec(v.spec, v.name, v.family, v.key, v.make_inputs, v.reference, **v.options)
            for v in specs.tuner_variants(package) if importlib.util.find_spec(f"{package}.{v.spec.module}")]


def templates(family: str | None = None) -> list[Template]:
    """Every registered template (optionally of one record family)."""
    return [t for t in family_templates() if family in (None, t.family)]


def gdn_templates(package: str = specs.TILES) -> list[Template]:
    """Gated DeltaNet's templates, from `package`'s kernel templates (another revision's, for an A/B run)."""
    return [t for t in family_templates(package) if t.family == "gdn"]


def mamba2_templates(package: str = specs.TILES) -> list[Template]:
    """Mamba-2's templates, from `package`'s kernel templates."""
    return [t for t in family_templates(package) if t.family == "mamba2"]
