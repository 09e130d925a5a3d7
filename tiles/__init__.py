"""kvbuffer.tiles: the TileLang kernel templates (compile side).

Nothing here imports TileLang at module import; `compile_template` imports it on demand.
"""

from __future__ import annotations

TARGET_SM90A = {"kind": "cuda", "arch": "sm_90a"}


def compile_template(prim_func, target: dict | None = None):
    """Compile a built template (a T.prim_func) for `target` (default sm_90a); every tensor is passed by the caller."""
    import tilelang

    return tilelang.compile(prim_func, target=target or TARGET_SM90A, out_idx=None)
