"""Where results land: one JSON per run (rewritten after every row), a PNG beside it, a table for kernels."""

from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_DIR = os.path.join("benchmarks", "results")  # relative to where the command runs


def result_path(out_dir: str | os.PathLike, stem: str, result: dict) -> Path:
    """out_dir/STEM_DATE_GPU.json, created on demand."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    return Path(out_dir) / f"{stem}_{result['date']}_{result['gpu'].replace(' ', '_')}.json"


def write(result: dict, path: Path) -> None:
    """Write atomically, so that a run stopped half-way leaves its last complete file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def finish(result: dict, path: Path, text: str | None = None) -> list[Path]:
    """The final JSON, the table (when given) and the figure (when matplotlib is there); the paths written."""
    from .plot import plot

    write(result, path)
    written = [path]
    if text is not None:
        path.with_suffix(".txt").write_text(text + "\n")
        written.append(path.with_suffix(".txt"))
    if plot(result, str(path.with_suffix(".png"))):
        written.append(path.with_suffix(".png"))
    else:
        print("matplotlib is not installed, so no figure: pip install 'kvbuffer[bench]'")
    return written
