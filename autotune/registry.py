"""Every tuner template `kvbuffer tune` knows, by record family ("gdn", "mamba2", "conv1d", "attention",
"gemv", "experts", "grouped", "fp8_gemv", "fp8_quant"); each is built from its kernel's KernelSpec
(kvbuffer.autotune.template)."""

from __future__ import annotations

import importlib.util

from .attention_templates import attention_templates
from .conv_templates import conv_templates
from .fp8_quant_templates import fp8_quant_templates
from .gemv_templates import gemv_templates
from .linear_templates import gdn_templates, mamba2_templates
from .template import TEMPLATE_IMPORTS, Template, capacity, source_digest

__all__ = ["TEMPLATE_IMPORTS", "Template", "capacity", "gdn_templates", "mamba2_templates", "source_digest",
           "templates"]


def templates(family: str | None = None) -> list[Template]:
    """Every registered template (optionally of one record family)."""
    found = gdn_templates()
    if importlib.util.find_spec("kvbuffer.tiles.mamba2") is not None:
        found += mamba2_templates()
    found += conv_templates() + attention_templates() + gemv_templates() + fp8_quant_templates()
    return [t for t in found if family in (None, t.family)]
