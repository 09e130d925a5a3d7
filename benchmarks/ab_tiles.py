"""A kernel template change measured as it should be: the templates of a git revision (the base)
against the working tree's (the change), built side by side and timed in one process.

For each kernel: both builds are checked against the fp64 reference and against each other (every
output and written buffer, bit for bit, at an awkward batch), then timed the way every kvbuffer
figure is (kvbuffer.bench.timing.graph_median: many launches in one CUDA graph, inputs rotated
past twice the L2), alternating base, change, change, base so that drift between them cancels; the
faster of each side's two medians is reported.

    python benchmarks/ab_tiles.py --base HEAD~1 --kernels mamba2_recurrent --tunables '{"BV": 8, "threads": 32}'
    python benchmarks/ab_tiles.py --base main --kernels gdn_buffered_step,gdn_verify --batches 1,16,256,1024
    python benchmarks/ab_tiles.py --base HEAD --kernels gdn_buffered_step --change-tunables '{"blocks": 2}'

The last form compares tunables, not templates: with --change-tunables the change side takes those
(over --tunables, or over each kernel's defaults), so one tunable is measured with the same rigor.

Kernel names are the registry's (`kvbuffer tune --help` lists them); without --tunables each kernel
takes its untuned defaults. Needs a CUDA GPU, TileLang and git. Writes a JSON next to the other results.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_PACKAGE = "kvbuffer._base_tiles"
FAMILY_MODELS = {"gdn": "qwen3.5-9b", "mamba2": "nemotron-3-nano"}
CHECK_BATCH = 257  # awkward: no power of two, more rows than SMs


def base_tiles(rev: str, into: Path) -> str:
    """tiles/ as of git revision `rev` (or of the directory `rev`, which holds a tiles/ folder: for a
    machine without the repository's history), copied under `into` and imported as BASE_PACKAGE, a
    subpackage of kvbuffer (its `..reference` imports resolve to the installed kvbuffer). Returns the
    package name."""
    if (Path(rev) / "tiles").is_dir():
        shutil.copytree(Path(rev) / "tiles", into / "tiles", ignore=shutil.ignore_patterns("__pycache__"))
    else:
        got = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, "tiles"], capture_output=True)
        if got.returncode:
            raise SystemExit(f"Error: --base {rev!r}: {got.stderr.decode().strip() or 'git archive failed'}")
        with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
            tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for name in [m for m in sys.modules if m == BASE_PACKAGE or m.startswith(BASE_PACKAGE + ".")]:
        del sys.modules[name]
    init = into / "tiles" / "__init__.py"
    spec = importlib.util.spec_from_file_location(BASE_PACKAGE, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BASE_PACKAGE] = module
    spec.loader.exec_module(module)
    return BASE_PACKAGE


def templates_of(package: str) -> dict:
    """The registry's GDN and Mamba-2 templates built on `package`'s tiles, by name."""
    from kvbuffer.autotune import registry

    return {t.name: t for t in registry.gdn_templates(package) + registry.mamba2_templates(package)}


def _same_outputs(tpl, kernels: dict, shape, drafts: int) -> bool:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(7)
    args = tpl.inputs(shape, CHECK_BATCH, 16, "cuda", gen, drafts)
    copies = {side: [a.clone() if isinstance(a, torch.Tensor) else a for a in args] for side in kernels}
    for side, kernel in kernels.items():
        tpl.run(kernel, copies[side])
    torch.cuda.synchronize()
    base, change = copies.values()
    return all(torch.equal(x, y) for x, y in zip(base, change) if isinstance(x, torch.Tensor))


def compare(name: str, sides: dict, *, tunables: dict | None, batches: list[int], drafts: int, target: dict,
            change_tunables: dict | None = None) -> list:
    """Rows {kernel, tunables, B, base_us, change_us, ...} for one kernel built from both sides."""
    import torch

    from kvbuffer.autotune.models import preset_shape
    from kvbuffer.autotune.tuner import check, rotation
    from kvbuffer.bench.timing import graph_median, l2_bytes

    family = name.split("_")[0]
    shape = preset_shape(FAMILY_MODELS[family])
    drafts = drafts if sides["change"][name].min_drafts else 0
    tun = dict(tunables) if tunables is not None else sides["change"][name].defaults_for(shape, drafts)
    tuns = {"base": tun, "change": {**tun, **(change_tunables or {})}}
    kernels = {side: tpls[name].compile(shape, 16, drafts, target=target, **tuns[side]) for side, tpls in sides.items()}
    errors = {side: check(sides[side][name], kernels[side], shape, 16, "cuda", drafts=drafts) for side in kernels}
    tpl = sides["change"][name]
    same = _same_outputs(tpl, kernels, shape, drafts)
    rows = []
    for B in batches:
        gen = torch.Generator(device="cuda").manual_seed(B)
        first = tpl.inputs(shape, B, 16, "cuda", gen, drafts)
        sets = [first] + [tpl.inputs(shape, B, 16, "cuda", gen, drafts) for _ in range(rotation(first, l2_bytes()) - 1)]
        nbytes = sum(a.numel() * a.element_size() for s in sets for a in s if hasattr(a, "element_size"))
        runs = {"base": [], "change": []}
        for side in ("base", "change", "change", "base"):
            kernel = kernels[side]
            timing = graph_median(lambda i: tpl.run(kernel, sets[i]), len(sets), rotated_bytes=nbytes)
            runs[side].append(timing.us)
        base_us, change_us = min(runs["base"]), min(runs["change"])
        rows.append(dict(kernel=name, tunables=tun, change_tunables=tuns["change"], drafts=drafts, B=B,
                         base_us=base_us, change_us=change_us,
                         speedup=base_us / change_us, runs_us=runs, rel_err=errors, bit_identical=same,
                         timing=timing.method))
        print(f"{name:24s} B={B:5d} base {base_us:9.2f} us  change {change_us:9.2f} us  x{base_us / change_us:.3f}"
              f"  rel err {errors['change']:.1e}  bit-identical {same}", flush=True)
        del sets, first
        torch.cuda.empty_cache()
    return rows


def _json_object(text: str | None, flag: str) -> dict | None:
    """The JSON object a flag was given (None without one), or a one-line error."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise SystemExit(f"Error: {flag} must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise SystemExit(f"Error: {flag} must be a JSON object, got {text!r}")
    return value


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True,
                   help="git revision whose tiles/ is the baseline (e.g. HEAD, main), or a directory holding a tiles/")
    p.add_argument("--kernels", required=True, help="comma-separated template names (gdn_recurrent, ...)")
    p.add_argument("--tunables", help="JSON object of tunables for every kernel (default: each one's defaults)")
    p.add_argument("--change-tunables", help="JSON object of tunables the change side takes over those (to A/B a "
                                             "tunable: --base HEAD)")
    p.add_argument("--batches", default="1,4,16,64,256,1024")
    p.add_argument("--drafts", type=int, default=4, help="draft tokens of a verify's buffer layout")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    a = p.parse_args(argv)
    tunables = _json_object(a.tunables, "--tunables")
    change_tunables = _json_object(a.change_tunables, "--change-tunables")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError as e:
        raise SystemExit(f"Error: --batches must be integers: {e}") from None
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("Error: ab_tiles times GPU kernels and needs a CUDA GPU; none is visible")
    from kvbuffer import gpus

    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": templates_of(base_tiles(a.base, Path(tmp))), "change": templates_of("kvbuffer.tiles")}
        unknown = [k for k in a.kernels.split(",") if k not in sides["change"]]
        if unknown:
            raise SystemExit(f"Error: unknown kernels {unknown}; known: {', '.join(sorted(sides['change']))}")
        target = gpus.local_target()
        rows = [r for k in a.kernels.split(",") for r in compare(k, sides, tunables=tunables, batches=batches,
                                                                  drafts=a.drafts, target=target,
                                                                  change_tunables=change_tunables)]
    gpu = torch.cuda.get_device_name(0)
    path = Path(a.out) / f"ab_tiles_{datetime.date.today().isoformat()}_{gpu.replace(' ', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(base=a.base, gpu=gpu, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
