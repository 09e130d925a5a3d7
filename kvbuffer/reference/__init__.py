"""Pure-torch reference of everything kvbuffer computes (CPU or CUDA, fp32 or fp64).

`core` is the generic recurrence (delta rule on or off); `gdn` and `mamba2` add each family's
gating front; `conv` is the short causal conv with draft rollback; `experts` a mixture-of-experts layer's matmul
over rows sorted by expert. Every kernel is tested against
these, and the tuner rejects variants that disagree with them.
"""

from . import conv, core, experts, gating, gdn, mamba2

__all__ = ["conv", "core", "experts", "gating", "gdn", "mamba2"]
