"""Compile many GDN kernel variants in parallel processes to fill TileLang's disk cache.

A later `tilelang.compile` of the same template and parameters is then a cache hit (~0.2 s),
so the GPU tests and the benchmark do not pay ~5-10 s per kernel one after the other.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed


def _compile(spec: dict) -> tuple[str, float, str]:
    t = time.time()
    try:
        import importlib

        gdn = importlib.import_module("kvbuffer.tiles.gdn")
        tiles = importlib.import_module("kvbuffer.tiles")
        args = dict(spec)
        template = args.pop("template")
        tiles.compile_template(getattr(gdn, template)(**args))
        return json.dumps(spec), time.time() - t, "ok"
    except Exception as e:  # noqa: BLE001  (reported per spec)
        return json.dumps(spec), time.time() - t, f"{type(e).__name__}: {str(e)[-400:]}"


def specs(C: int = 16, cap: int = 24, tune: bool = True) -> list[dict]:
    """The GPU tests' kernels, the benchmark's, and (tune) every recurrent config and every buffered config at
    T = 1, 2, 4, 8 for the two benchmark shapes."""
    from kvbuffer.tiles.gdn import get_buffered_configs, get_recurrent_configs

    out = []
    heads = [(16, 16), (16, 32), (8, 32), (16, 48)]
    for Hk, Hv in heads:
        out.append(dict(template="gdn_recurrent", Hk=Hk, Hv=Hv))
        out.append(dict(template="gdn_buffered", Hk=Hk, Hv=Hv, cap=cap, T_new=1, flush_at=C))
        out.append(dict(template="gdn_flush", Hk=Hk, Hv=Hv, cap=cap))
        for T in (2, 4, 8):
            out.append(dict(template="gdn_buffered", Hk=Hk, Hv=Hv, cap=cap, T_new=T, flush_at=0))
    for T in (1, 3, 5, 6, 7):
        out.append(dict(template="gdn_buffered", Hk=16, Hv=32, cap=cap, T_new=T, flush_at=0))
    for T in (2, 4, 8):
        out.append(dict(template="gdn_buffered", Hk=16, Hv=32, cap=cap, T_new=T, flush_at=C))
    for Hk, Hv in [(16, 32), (16, 48)]:
        if tune:
            for cfg in get_recurrent_configs():
                out.append(dict(template="gdn_recurrent", Hk=Hk, Hv=Hv, **cfg))
            for cfg in get_buffered_configs():
                for T in (1, 2, 4, 8):
                    out.append(dict(template="gdn_buffered", Hk=Hk, Hv=Hv, cap=cap, T_new=T,
                                    flush_at=C if T == 1 else 0, **cfg))
    uniq = {json.dumps(s, sort_keys=True): s for s in out}
    return list(uniq.values())


def main(workers: int = 14, tune: bool = True) -> int:
    todo = specs(tune=tune)
    t0 = time.time()
    bad = 0
    with ProcessPoolExecutor(workers) as ex:
        for fut in as_completed([ex.submit(_compile, s) for s in todo]):
            spec, dt, status = fut.result()
            if status != "ok":
                bad += 1
                print(f"FAILED {spec}: {status}", flush=True)
    print(f"precompiled {len(todo) - bad}/{len(todo)} kernels in {time.time() - t0:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workers", nargs="?", type=int, default=14)
    ap.add_argument("--no-tune", action="store_true", help="skip the benchmark's tuning configs")
    a = ap.parse_args()
    sys.exit(main(a.workers, tune=not a.no_tune))
