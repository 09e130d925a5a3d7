"""kvbuffer.tiles: the TileLang kernel templates (compile side).

Nothing here imports TileLang at module import; `compile_template` imports it on demand. Every
compile names its target: `kvbuffer tune --gpu` the named GPU's, a JIT compile the local device's
(kvbuffer.gpus.local_target); a default would silently build for the wrong GPU.
"""

from __future__ import annotations


def compile_template(prim_func, target: dict):
    """Compile a built template (a T.prim_func) for `target` ({"kind": "cuda", "arch": "sm_.."});
    every tensor is passed by the caller."""
    if not isinstance(target, dict) or "arch" not in target:
        raise TypeError(f"target must be a TileLang target dict such as {{'kind': 'cuda', 'arch': 'sm_90a'}}, "
                        f"got {target!r}")
    import tilelang

    return tilelang.compile(prim_func, target=target, out_idx=None)
