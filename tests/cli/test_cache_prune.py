"""`kvbuffer cache prune` removes what `kvbuffer cache ls` calls removable: an interrupted tune's
unnamed artifacts (at any age unless --older-than says otherwise), its staging leftovers and the
entries the manifest does not list; what a running tune built is kept."""

import os
import time

import pytest
from click.testing import CliRunner

from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.cli.main import main

from tests.kernels.test_artifacts import make_key, put
from tests.kernels.test_cache_hardening import _dead_pid


def cli(*args):
    return CliRunner().invoke(main, list(args))


def _interrupted_tune(root):
    """A cache as a tune killed mid-group leaves it: a fresh artifact no record names, a staging dir
    of the dead process, an artifact directory and a record file the manifest never listed."""
    cache = ArtifactCache(root)
    unnamed = put(cache, make_key(source="the interrupted group"))
    dead = _dead_pid()
    (root / "staging" / f"gdn_flush_x.{dead}.0123abcd").mkdir(parents=True)
    (root / "artifacts" / "gdn_flush_unlisted").mkdir()
    (root / "artifacts" / "gdn_flush_unlisted" / "kernel.so").write_bytes(b"half")
    (root / "tunings").mkdir(exist_ok=True)
    (root / "tunings" / "never_listed.json").write_text("{}")
    (root / f".manifest.json.{dead}.89abcdef").write_text("{")
    return cache, unnamed


def test_prune_removes_what_ls_calls_removable(tmp_path):
    root = tmp_path / "cache"
    cache, unnamed = _interrupted_tune(root)
    listing = cli("cache", "ls", "--cache-dir", str(root)).output
    assert "1 artifact (" in listing and "interrupted tune" in listing
    assert "4 leftover files of interrupted builds" in listing
    result = cli("cache", "prune", "--cache-dir", str(root))
    assert result.exit_code == 0, result.output
    assert "removed 1 unused artifact " in result.output and "and 4 leftovers of interrupted builds" in result.output
    assert cache.manifest()["artifacts"] == {} and list((root / "staging").iterdir()) == []
    assert list((root / "artifacts").iterdir()) == [] and list((root / "tunings").iterdir()) == []
    assert not list(root.glob(".manifest.json.*")) and (root / ".lock").exists()
    after = cli("cache", "ls", "--cache-dir", str(root)).output
    assert "`kvbuffer cache prune`" not in after


@pytest.mark.parametrize("flag", [["--older-than", "2h"], ["--older-than", "90m"], ["--older-than", "1.5"],
                                  ["--keep-hours", "2"]], ids=["hours", "minutes", "bare-number", "keep-hours"])
def test_older_than_keeps_the_young_and_says_so(tmp_path, flag):
    root = tmp_path / "cache"
    cache = ArtifactCache(root)
    young = put(cache, make_key(source="built just now"))
    old = put(cache, make_key(source="built yesterday"))
    past = time.time() - 86400
    os.utime(cache.artifact_dir(old), (past, past))
    result = cli("cache", "prune", "--cache-dir", str(root), *flag)
    assert result.exit_code == 0, result.output
    assert "removed 1 unused artifact " in result.output and "kept 1 built in the last" in result.output
    assert set(cache.manifest()["artifacts"]) == {young}
    assert "removed 1 unused artifact " in cli("cache", "prune", "--cache-dir", str(root)).output  # default: any age


@pytest.mark.parametrize("value", ["soon", "-1h", "h"])
def test_a_bad_older_than_is_a_usage_error(tmp_path, value):
    result = cli("cache", "prune", "--cache-dir", str(tmp_path), "--older-than", value)
    assert result.exit_code == 2 and "--older-than" in result.output and "Traceback" not in result.output


def test_a_running_tunes_unnamed_artifacts_are_kept_at_any_age_setting(tmp_path):
    root = tmp_path / "cache"
    cache = ArtifactCache(root)
    with cache.tune_running():
        building = put(cache, make_key(source="a group still measuring"))
        plan = cache.prune()
        assert plan.artifacts == [] and plan.kept_running == 1 and plan.staging == []  # its mark stays
        assert set(cache.manifest()["artifacts"]) == {building}
    assert cache.running_tunes() == [] and cache.prune().artifacts == [building]
