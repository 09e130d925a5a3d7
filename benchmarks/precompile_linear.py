"""Compile the kernels the GPU tests and benchmarks use, in parallel processes (fills TileLang's disk cache).

Covers both families (GDN via precompile_gdn.specs, Mamba-2 here); a later compile of the same template
and parameters is a cache hit.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def _compile(spec: dict) -> tuple[str, float, str]:
    import importlib

    t = time.time()
    try:
        args = dict(spec)
        module, template = args.pop("module", "gdn"), args.pop("template")
        prim = getattr(importlib.import_module(f"kvbuffer.tiles.{module}"), template)(**args)
        importlib.import_module("kvbuffer.tiles").compile_template(prim)
        return json.dumps(spec), time.time() - t, "ok"
    except Exception as e:  # noqa: BLE001  (reported per spec)
        return json.dumps(spec), time.time() - t, f"{type(e).__name__}: {str(e)[-400:]}"


def mamba2_specs(C: int = 16, cap: int = 24, tune: bool = True) -> list[dict]:
    from kvbuffer.tiles.mamba2 import get_buffered_configs, get_recurrent_configs

    m = dict(module="mamba2", N=128, P=64)
    out = []
    for G, H in [(8, 64), (8, 128)]:
        for z in (True, False):
            out.append(dict(m, template="mamba2_recurrent", G=G, H=H, has_z=z))
        out.append(dict(m, template="mamba2_buffered", G=G, H=H, cap=cap, T_new=1, flush_at=C, has_z=True))
        out.append(dict(m, template="mamba2_flush", G=G, H=H, cap=cap))
        for T in (2, 4, 8):
            out.append(dict(m, template="mamba2_buffered", G=G, H=H, cap=cap, T_new=T, flush_at=0, has_z=True))
            out.append(dict(m, template="mamba2_buffered", G=G, H=H, cap=cap, T_new=T, flush_at=0, has_z=False))
        if tune:
            for cfg in get_recurrent_configs():
                out.append(dict(m, template="mamba2_recurrent", G=G, H=H, has_z=True, **cfg))
            for cfg in (c for c in get_buffered_configs() if 64 % c["BV"] == 0):
                out.append(dict(m, template="mamba2_buffered", G=G, H=H, cap=cap, T_new=1, flush_at=C, has_z=True,
                                **cfg))
    for T in range(1, 9):
        out.append(dict(m, template="mamba2_buffered", G=8, H=64, cap=cap, T_new=T, flush_at=0, has_z=True))
    for T in (1, 2, 4, 8):
        out.append(dict(m, template="mamba2_buffered", G=8, H=64, cap=cap, T_new=T, flush_at=C, has_z=True))
    # the tests build every default-config buffered kernel in both variants (tests/gpu/test_mamba2_kernels.py)
    plain = [s for s in out if s["template"] == "mamba2_buffered" and "BV" not in s]
    out = [s for s in out if s not in plain] + [dict(s, variant="simt") for s in plain] + \
        [dict(s, variant="reduce", threads=128, blocks=0) for s in plain]
    return out


def main(workers: int = 15, which: str = "all") -> int:
    from precompile_gdn import specs as gdn_specs

    todo = []
    if which in ("all", "mamba2"):
        todo += mamba2_specs()
    if which in ("all", "gdn"):
        todo += gdn_specs(tune=False)
    todo = list({json.dumps(s, sort_keys=True): s for s in todo}.values())
    t0, bad = time.time(), 0
    with ProcessPoolExecutor(workers) as ex:
        for fut in as_completed([ex.submit(_compile, s) for s in todo]):
            spec, dt, status = fut.result()
            if status != "ok":
                bad += 1
                print(f"FAILED {spec}: {status}", flush=True)
    print(f"precompiled {len(todo) - bad}/{len(todo)} kernels in {time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 15, sys.argv[2] if len(sys.argv) > 2 else "all"))
