"""Packaging promises: no TileLang at import, no generic top-level names, a working console script, and
a plain install (core dependencies only) that runs the bundled demo."""

import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

from click.testing import CliRunner


def test_import_kvbuffer_does_not_import_tilelang():
    code = "import sys, kvbuffer, kvbuffer.reference, kvbuffer.pools; print('tilelang' in sys.modules, 'tvm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_subpackages_install_under_kvbuffer():
    for name in ("kvbuffer.tiles", "kvbuffer.autotune", "kvbuffer.cli"):
        assert importlib.util.find_spec(name) is not None, name
    for generic in ("tiles", "autotune", "cli"):
        spec = importlib.util.find_spec(generic)
        assert spec is None or "site-packages" not in (spec.origin or ""), f"top-level '{generic}' installed"


def test_every_package_is_listed_for_install():
    """pyproject's explicit package list names every directory with an __init__.py (a package missing from
    it is left out of a non-editable install: the editable one used by the tests would not notice)."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = pathlib.Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: root / path for name, path in config["package-dir"].items()}
    found = {".".join([top, *init.parent.relative_to(path).parts])
             for top, path in dirs.items() for init in path.rglob("__init__.py")}
    assert found <= set(config["packages"]), sorted(found - set(config["packages"]))


def test_cli_env_runs(tmp_path, monkeypatch):
    from kvbuffer import gpus
    from kvbuffer.cli.main import main

    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["env"])
    assert result.exit_code == 0, result.output
    assert "torch" in result.output and "kvbuffer" in result.output and str(tmp_path) in result.output
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    result = CliRunner().invoke(main, ["env"])
    assert "0 of 0 built for this h200 (sm_90a)" in result.output


def test_env_marks_tuning_records_of_other_template_sources(tmp_path, monkeypatch):
    """`kvbuffer env` shows the templates' digest and lists a record tuned before a template edit as not
    used, beside one of this process's versions."""
    from click.testing import CliRunner

    from kvbuffer import gpus
    from kvbuffer.artifacts import runtime_versions
    from kvbuffer.autotune.cache import ArtifactCache
    from kvbuffer.cli.main import main
    from kvbuffer.tuning import make_shape, tuning_name
    from tests.support.tuning_records import empty_record

    cache = ArtifactCache(tmp_path)
    for shape, versions in ((make_shape("gdn", 16, 32, 128, 128), {**runtime_versions(), "templates": "0" * 16}),
                            (make_shape("mamba2", 8, 64, 128, 64), runtime_versions())):
        cache.put_tuning(tuning_name("h200", "sm_90a", shape, versions), empty_record(), gpu="h200", shape=shape,
                         versions=versions)
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    out = CliRunner().invoke(main, ["env"]).output
    assert runtime_versions()["templates"] in out
    lines = {line.split(":")[0].split()[-1]: line for line in out.splitlines() if line.startswith("tuning record")}
    assert "built with another template source: not used" in lines["gdn_hk16_hv32_k128_v128_bf16"], out
    assert "not used" not in lines["mamba2_hk8_hv64_k128_v64_bf16"], out


def test_cli_lists_its_commands_and_bench_needs_a_gpu():
    import torch

    from kvbuffer.cli.main import main

    result = CliRunner().invoke(main, ["--help"])
    for command in ("env", "generate", "bench", "tune", "cache"):
        assert command in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, ["bench", "gdn"])
        assert result.exit_code != 0 and "needs a CUDA GPU" in result.output



DEMO_WITH_ONLY = """
import importlib.machinery, json, sys

# The distributions outside the core dependencies are not found, as if not installed.
blocked = set(json.loads(sys.argv[1]))
path_find_spec = importlib.machinery.PathFinder.find_spec
importlib.machinery.PathFinder.find_spec = classmethod(
    lambda cls, name, path=None, target=None:
        None if name.partition(".")[0] in blocked else path_find_spec(name, path, target))
from click.testing import CliRunner
from kvbuffer.cli.main import main
for args in (["--help"], ["generate", "--help"], ["env"], ["generate", "--prompt", "The ", "--max-new-tokens", "2"]):
    result = CliRunner().invoke(main, args)
    if result.exit_code != 0:
        sys.exit(f"kvbuffer {' '.join(args)}: {result.output}")
"""


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_dependencies() -> set[str]:
    """pyproject's core dependencies and, installed, everything they require (extras excluded)."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.M | re.S).group(1)
    todo = [_normalized(n) for n in re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_normalized(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in requires if "extra ==" not in r]
    return seen


def test_the_demo_runs_on_the_core_dependencies_alone():
    """`kvbuffer --help`, `generate --help`, `env` and `generate` on the bundled demo, with every installed distribution outside pyproject's core
    dependencies hidden from the import system: what a plain install (no extras) has. CI also runs the
    demo after a real plain install in a fresh venv."""
    keep = core_dependencies() | {"kvbuffer"}
    blocked = sorted(module for module, dists in importlib.metadata.packages_distributions().items()
                     if not {_normalized(d) for d in dists} & keep)
    assert "transformers" in blocked or importlib.util.find_spec("transformers") is None
    run = subprocess.run([sys.executable, "-c", DEMO_WITH_ONLY, json.dumps(blocked)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
