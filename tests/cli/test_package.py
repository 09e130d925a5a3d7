"""Packaging promises: no TileLang at import, no generic top-level names, a working console script."""

import importlib.util
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


def test_cli_lists_its_commands_and_bench_needs_a_gpu():
    import torch

    from kvbuffer.cli.main import main

    result = CliRunner().invoke(main, ["--help"])
    for command in ("env", "generate", "bench", "tune", "cache"):
        assert command in result.output
    if not torch.cuda.is_available():
        result = CliRunner().invoke(main, ["bench", "gdn"])
        assert result.exit_code != 0 and "needs a CUDA GPU" in result.output
