"""The artifact cache against altered, corrupt or hostile contents: nothing outside the cache root is
read or deleted, every bad manifest or record is one ArtifactError that `cache clear` repairs, a
clear never strands a running tune, and a record cannot point one kernel at another's artifact."""

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbuffer import artifacts
from kvbuffer.artifacts import LIBRARY, ArtifactStore, empty_manifest
from kvbuffer.autotune.cache import STALE_STAGING_S, ArtifactCache
from kvbuffer.cli.main import main
from kvbuffer.errors import ArtifactError
from kvbuffer.tuning import ChunkPolicy

from tests.kernels.test_artifacts import SHAPE, make_key, put

BAD_MANIFESTS = {
    "not-json": "{not json",
    "empty-object": "{}",
    "list": "[]",
    "other-format": json.dumps({"format": 2, "artifacts": {}, "tunings": {}}),
    "no-artifacts": json.dumps({"format": 1, "tunings": {}}),
    "no-files": json.dumps({"format": 1, "tunings": {}, "artifacts": {"a": {"status": "tuned"}}}),
    "no-status": json.dumps({"format": 1, "tunings": {}, "artifacts": {"a": {"files": {}}}}),
    "dotdot-name": json.dumps({"format": 1, "tunings": {}, "artifacts": {"..": {"status": "tuned", "files": {}}}}),
}


@pytest.fixture
def root(tmp_path) -> Path:
    """A cache root with a sentinel directory next to it that nothing may touch."""
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "precious.txt").write_text("keep me")
    return tmp_path / "cache"


def sentinel_intact(root: Path) -> bool:
    return (root.parent / "victim" / "precious.txt").read_text() == "keep me"


def cli(*args):
    return CliRunner().invoke(main, list(args))


def one_error_line(result, text: str):
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and text in errors[0], result.output


def record_for(winners: list[dict]) -> dict:
    return {"status": "untuned", "chunk_policy": ChunkPolicy.default([1], [16]).to_json(), "batch_buckets": [1],
            "chunk_sizes": [16], "winners": winners}


def winner(kernel: str, artifact: str, chunk_size: int = 0) -> dict:
    return {"kernel": kernel, "batch_bucket": 1, "chunk_size": chunk_size, "drafts": 0, "artifact": artifact,
            "tunables": {}, "median_us": None}


# ----------------------------------------------------------------------------------------------
# 1. nothing outside the root


def _write_manifest(root: Path, artifacts_: dict, tunings: dict | None = None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(json.dumps({"format": 1, "artifacts": artifacts_, "tunings": tunings or {}}))


@pytest.mark.parametrize("name", ["../../victim", "../victim", "/abs/victim", "a/../../../victim"])
def test_clear_never_deletes_outside_the_root_by_an_entry_name(root, name):
    put(ArtifactCache(root), make_key())  # artifacts/ and tunings/ exist, so '..' resolves from them
    (root / "tunings").mkdir()
    _write_manifest(root, {name: {"status": "tuned", "files": {}}}, {name: {"status": "tuned", "files": {}}})
    r = cli("cache", "clear", "--yes", "--cache-dir", str(root))
    assert r.exit_code == 0, r.output
    assert sentinel_intact(root)
    assert ArtifactStore(root).manifest() == empty_manifest()


def test_a_file_path_outside_the_root_is_refused_not_read(root):
    cache = ArtifactCache(root)
    name = put(cache, make_key())
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["artifacts"][name]["files"]["../victim/precious.txt"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="outside the cache root"):
        ArtifactStore(root).load(name, arch=None)
    assert not [r for r in cache.entries() if r["ok"]]
    cache.clear()
    assert sentinel_intact(root)


def test_a_symlinked_artifact_dir_is_unlinked_not_followed(root):
    cache = ArtifactCache(root)
    name = put(cache, make_key())
    target = cache.artifact_dir(name)
    for f in target.iterdir():
        f.unlink()
    target.rmdir()
    target.symlink_to(root.parent / "victim", target_is_directory=True)
    with pytest.raises(ArtifactError, match="outside the cache root"):
        ArtifactStore(root).verify(name)
    assert cache.clear() == 1
    assert sentinel_intact(root) and not target.exists() and not target.is_symlink()


def test_a_winner_naming_a_path_is_a_corrupt_record(root):
    cache = ArtifactCache(root)
    cache.put_tuning("t", record_for([]), gpu="h200", shape=SHAPE, versions={})
    path = cache.tuning_path("t")
    path.write_text(json.dumps(record_for([winner("gdn_recurrent", "../../victim")])))
    manifest = json.loads((root / "manifest.json").read_text())
    from kvbuffer.artifacts import sha256_file
    manifest["tunings"]["t"]["files"] = {"tunings/t.json": sha256_file(path)}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not an entry name"):
        cache.tuning("t")


# ----------------------------------------------------------------------------------------------
# 12. bad manifests: one ArtifactError everywhere, and clear repairs them


@pytest.mark.parametrize("text", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_a_bad_manifest_is_one_clear_error_and_clear_repairs_it(root, text, monkeypatch):
    cache = ArtifactCache(root)
    name = put(cache, make_key())
    (root / "manifest.json").write_text(text)
    with pytest.raises(ArtifactError, match="kvbuffer cache clear"):
        ArtifactStore(root).manifest()
    with pytest.raises(ArtifactError):
        ArtifactStore(root).load(name, arch=None)
    one_error_line(cli("cache", "ls", "--cache-dir", str(root)), "cache manifest")
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(root))
    r = cli("env")
    assert r.exit_code == 0 and "unreadable" in r.output, r.output
    r = cli("cache", "clear", "--yes", "--cache-dir", str(root))
    assert r.exit_code == 0, r.output
    assert ArtifactStore(root).manifest() == empty_manifest()
    assert cli("cache", "ls", "--cache-dir", str(root)).exit_code == 0
    assert sentinel_intact(root)


def test_a_manifest_that_is_a_directory_is_repaired_by_clear(root):
    cache = ArtifactCache(root)
    put(cache, make_key())
    (root / "manifest.json").unlink()
    (root / "manifest.json").mkdir()
    with pytest.raises(ArtifactError, match="unreadable cache manifest"):
        cache.manifest()
    cache.clear()
    assert cache.manifest() == empty_manifest() and sentinel_intact(root)


def test_a_cache_dir_that_is_a_file_is_an_artifact_error(root, monkeypatch):
    root.write_text("not a directory")
    cache = ArtifactCache(root)
    for call in (cache.manifest, cache.clear, lambda: put(cache, make_key())):
        with pytest.raises(ArtifactError, match=str(root)):
            call()
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(root))  # (--cache-dir FILE is click's usage error)
    one_error_line(cli("cache", "clear", "--yes"), str(root))
    one_error_line(cli("cache", "ls"), str(root))
    assert root.read_text() == "not a directory"


def test_an_unwritable_cache_dir_is_an_artifact_error(root, monkeypatch):
    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(ArtifactError, match="Permission denied"):
        put(ArtifactCache(root), make_key())
    with pytest.raises(ArtifactError, match="cannot write the kernel cache"):
        ArtifactCache(root).clear()


def test_an_unreadable_kernel_file_is_an_artifact_error(root, monkeypatch):
    cache = ArtifactCache(root)
    name = put(cache, make_key())

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(artifacts, "sha256_file", denied)
    with pytest.raises(ArtifactError, match=f"cannot read .*{LIBRARY}"):
        ArtifactStore(root).load(name, arch=None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_an_unreadable_kernel_file_by_its_mode(root):
    cache = ArtifactCache(root)
    name = put(cache, make_key())
    (cache.artifact_dir(name) / LIBRARY).chmod(0)
    with pytest.raises(ArtifactError, match="cannot read"):
        ArtifactStore(root).load(name, arch=None)


# ----------------------------------------------------------------------------------------------
# 4. clear and tune: the lock, stranded records, stale staging


def _dead_pid() -> int:
    pid = 2 ** 22 - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_clear_removes_stale_staging_and_keeps_a_live_writers(root):
    cache = ArtifactCache(root)
    staging = root / "staging"
    killed = staging / f"gdn_flush_x.{_dead_pid()}.0123abcd"       # a SIGKILLed tune's build
    live = staging / f"gdn_flush_y.{os.getpid()}.89abcdef"          # a tune compiling right now
    old = staging / f"gdn_flush_z.{os.getpid()}.deadbeef"           # alive but abandoned for a day
    for d in (killed, live, old):
        d.mkdir(parents=True)
        (d / LIBRARY).write_bytes(b"half a library")
    past = time.time() - STALE_STAGING_S - 60
    os.utime(old, (past, past))
    cache.clear()
    assert not killed.exists() and not old.exists()
    assert (live / LIBRARY).exists()
    assert sentinel_intact(root)


def test_clear_waits_for_the_lock(root):
    cache = ArtifactCache(root)
    put(cache, make_key())
    import threading

    done = threading.Event()
    with cache.lock():
        t = threading.Thread(target=lambda: (ArtifactCache(root).clear(), done.set()))
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and cache.manifest()["artifacts"]
    t.join(10)
    assert done.is_set() and not cache.manifest()["artifacts"]


def test_a_record_is_not_published_when_clear_removed_its_artifacts(root):
    cache = ArtifactCache(root)
    name = put(cache, make_key())
    cache.clear()  # as if `cache clear` ran between the tune's artifacts and its record
    with pytest.raises(ArtifactError, match="cache clear"):
        cache.put_tuning("t", record_for([winner("gdn_flush", name, 16)]), gpu="h200", shape=SHAPE, versions={})
    assert cache.manifest()["tunings"] == {}


# ----------------------------------------------------------------------------------------------
# 5. a record pointing one kernel at another kind's artifact


@pytest.fixture
def fake_gpu(monkeypatch, root):
    from kvbuffer import gpus
    from kvbuffer.kernels import lookup

    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpus.get_gpu("h200"))
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(root))
    lookup.allow_jit(False)
    lookup.clear_kernels()
    yield gpus.get_gpu("h200")
    lookup.allow_jit(None)
    lookup.clear_kernels()


@pytest.mark.parametrize("change", [
    dict(kernel="gdn_flush"),                                              # another template
    dict(kernel="gdn_recurrent", shape=dict(SHAPE, Hv=16)),                # another head shape
    dict(kernel="gdn_recurrent", chunk_size=0, drafts=2),                  # another buffer layout
], ids=["template", "shape", "layout"])
def test_a_record_pointing_at_another_kinds_artifact_is_refused(root, fake_gpu, change):
    from kvbuffer.kernels.keys import GDNDims, KernelKey
    from kvbuffer.kernels.lookup import kernel_for
    from kvbuffer.tuning import tuning_name

    cache = ArtifactCache(root)
    key = make_key(gpu=fake_gpu.name, arch=fake_gpu.arch, **dict(dict(chunk_size=16), **change))
    name = put(cache, key, sm=int(fake_gpu.arch[3:5]))
    tname = tuning_name(fake_gpu.name, fake_gpu.arch, SHAPE, artifacts.runtime_versions())
    cache.put_tuning(tname, record_for([winner("gdn_recurrent", name)]), gpu=fake_gpu.name, shape=SHAPE,
                     versions=artifacts.runtime_versions())
    with pytest.raises(ArtifactError, match="the tuning record names it for gdn_recurrent"):
        kernel_for(KernelKey("gdn", "recurrent", GDNDims(16, 32, 128, 128), "bfloat16"))


# ----------------------------------------------------------------------------------------------
# prune: only what no tuning record names, never a running tune's, never outside the root


def _age(cache: ArtifactCache, name: str, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(cache.artifact_dir(name), (past, past))


def test_prune_removes_only_artifacts_no_record_names_and_keeps_a_running_tunes(root):
    cache = ArtifactCache(root)
    kept = put(cache, make_key())
    superseded = put(cache, make_key(source="an older template"))
    cache.put_tuning("t", record_for([winner("gdn_flush", kept, 16)]), gpu="h200", shape=SHAPE, versions={})
    for name in (kept, superseded):
        _age(cache, name, 2 * 3600)
    with cache.tune_running():
        building = put(cache, make_key(source="a tune still measuring"))
        assert {r["name"]: r["used"] for r in cache.entries() if r["type"] == "artifact"} == {
            kept: True, superseded: False, building: False}
        listing = cli("cache", "ls", "--cache-dir", str(root)).output
        assert "1 artifact " in listing and "`kvbuffer cache prune` removes them" in listing
        assert "built by a tune still running: `kvbuffer cache prune` keeps them" in listing

        result = cli("cache", "prune", "--cache-dir", str(root))
        assert result.exit_code == 0 and "removed 1 unused artifact " in result.output, result.output
        assert "kept 1 built by a tune still running" in result.output
        assert set(cache.manifest()["artifacts"]) == {kept, building}
        assert not cache.artifact_dir(superseded).exists() and cache.artifact_dir(kept).exists()
        cache.verify(kept)  # what the record names is intact
    plan = cache.prune()  # the tune is over: its unnamed build goes too
    assert plan.artifacts == [building] and plan.bytes > 0
    assert set(cache.manifest()["artifacts"]) == {kept}
    assert sentinel_intact(root)


def test_prune_with_an_unreadable_record_removes_nothing(root):
    cache = ArtifactCache(root)
    named = put(cache, make_key())
    other = put(cache, make_key(source="an older template"))
    cache.put_tuning("t", record_for([winner("gdn_flush", named, 16)]), gpu="h200", shape=SHAPE, versions={})
    cache.tuning_path("t").write_text("{not json")
    _age(cache, other, 2 * 3600)
    one_error_line(cli("cache", "prune", "--cache-dir", str(root)), "cannot be read")
    assert set(cache.manifest()["artifacts"]) == {named, other}
    assert "named by no tuning record" not in cli("cache", "ls", "--cache-dir", str(root)).output
