"""Property suite: random corruptions of a small built cache (fake artifacts, a tuning record), then
every reader: the manifest, verify, tuning records, `cache ls` (API and CLI), `kvbuffer env`, the
kernel lookup, and finally `cache clear --yes`. Each reader gives a result or one ArtifactError and
writes nothing; nothing outside the cache root is read into a result or touched; clear always
leaves an empty, valid cache. Bounded: a fixed number of derandomized examples."""

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvbuffer import artifacts
from kvbuffer.artifacts import ArtifactStore, empty_manifest, runtime_versions, sha256_file
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.cli.main import main
from kvbuffer.errors import ArtifactError
from kvbuffer.kernels.keys import GDNDims, KernelKey
from kvbuffer.tuning import TuningStore, tuning_name
from tests.kernels.test_artifacts import SHAPE, make_key, put
from tests.kernels.test_cache_hardening import record_for, winner

BOUNDED = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
HOSTILE_NAMES = ["..", ".", "../victim", "../../victim", "/tmp", "a/b", ".hidden", "", "victim/../..", "x\x00y"]
HOSTILE_PATHS = ["../victim/precious.txt", "/etc/hostname", "artifacts/../../victim/precious.txt",
                 "artifacts", ".", "../victim", "manifest.json"]
JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                max_size=3), max_leaves=6)
KEY = KernelKey("gdn", "recurrent", GDNDims(16, 32, 128, 128), "bfloat16")


def tree_digest(path: Path) -> dict:
    """path -> sha256 (or 'dir' / 'link') of everything under `path`, links not followed."""
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = "link" if p.is_symlink() else "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def build(root: Path, gpu) -> None:
    """Two artifacts (one the record's winner) and the GPU's tuning record for SHAPE."""
    cache = ArtifactCache(root)
    sm = int(gpu.arch[3:5])
    name = put(cache, make_key(gpu=gpu.name, arch=gpu.arch, kernel="gdn_recurrent", chunk_size=0), sm=sm)
    put(cache, make_key(gpu=gpu.name, arch=gpu.arch), sm=sm)
    tname = tuning_name(gpu.name, gpu.arch, SHAPE, runtime_versions())
    cache.put_tuning(tname, record_for([winner("gdn_recurrent", name)]), gpu=gpu.name, shape=SHAPE,
                     versions=runtime_versions())


# ----------------------------------------------------------------------------------------------
# corruptions: each takes the root, a random source and a drawn JSON value


def _manifest(root):
    return json.loads((root / "manifest.json").read_text())


def _save(root, manifest):
    (root / "manifest.json").write_text(json.dumps(manifest))


def _entry(manifest, rng):
    section = rng.choice(["artifacts", "tunings"])
    return section, rng.choice(sorted(manifest[section]))


def replace_manifest(root, rng, value):
    (root / "manifest.json").write_text(json.dumps(value))


def garble_manifest(root, rng, value):
    text = (root / "manifest.json").read_text()
    i = rng.randrange(len(text))
    (root / "manifest.json").write_text(text[:i] + rng.choice(["", "}", "\x00", "[", '"']) + text[i + 1:])


def drop_field(root, rng, value):
    m = _manifest(root)
    section, name = _entry(m, rng)
    where = rng.choice([m, m[section], m[section][name]])
    if where:
        del where[rng.choice(sorted(where))]
    _save(root, m)


def set_field(root, rng, value):
    m = _manifest(root)
    section, name = _entry(m, rng)
    m[section][name][rng.choice(["status", "files", "gpu", "shape", "versions"])] = value
    _save(root, m)


def hostile_name(root, rng, value):
    m = _manifest(root)
    section, name = _entry(m, rng)
    m[section][rng.choice(HOSTILE_NAMES)] = m[section].pop(name)
    _save(root, m)


def hostile_path(root, rng, value):
    m = _manifest(root)
    section, name = _entry(m, rng)
    m[section][name]["files"][rng.choice(HOSTILE_PATHS)] = "0" * 64
    _save(root, m)


def _a_file(root, rng):
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (".lock",))
    return rng.choice(files)


def damage_file(root, rng, value):
    path = _a_file(root, rng)
    data = path.read_bytes()
    how = rng.choice(["truncate", "flip", "empty", "delete", "dir"])
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip" and data:
        i = rng.randrange(len(data))
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    else:
        path.unlink()
        path.mkdir()


def link_out(root, rng, value):
    """An artifact directory or tuning file replaced by a symlink to the sentinel next to the root."""
    target = rng.choice(sorted(p for p in (root / "artifacts").iterdir()) + sorted((root / "tunings").iterdir()))
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    victim = root.parent / "victim"
    target.symlink_to(victim if target.suffix != ".json" else victim / "precious.txt")


def rewrite_json_file(root, rng, value):
    """meta.json or the tuning record replaced by drawn JSON, with the manifest's checksum updated
    (what someone who edits a cache by hand does)."""
    path = rng.choice(sorted(root.glob("artifacts/*/meta.json")) + sorted(root.glob("tunings/*.json")))
    original = json.loads(path.read_text())
    if isinstance(value, dict) and rng.random() < 0.5:
        value = dict(original, **value)
    if rng.random() < 0.5 and "winners" in original:  # point the winner at the other kind's artifact
        other = [p.name for p in (root / "artifacts").iterdir() if p.name != original["winners"][0]["artifact"]]
        value = dict(original, winners=[dict(original["winners"][0], artifact=rng.choice(other + HOSTILE_NAMES))])
    path.write_text(json.dumps(value))
    m = _manifest(root)
    for section in m.values():
        for entry in section.values() if isinstance(section, dict) else ():
            rel = str(path.relative_to(root))
            if rel in entry.get("files", {}):
                entry["files"][rel] = sha256_file(path)
    _save(root, m)


CORRUPTIONS = {f.__name__: f for f in (replace_manifest, garble_manifest, drop_field, set_field, hostile_name,
                                       hostile_path, damage_file, link_out, rewrite_json_file)}


# ----------------------------------------------------------------------------------------------
# the readers


def _readers(root: Path):
    store = TuningStore(root)

    def verify_all():
        for name in store.manifest()["artifacts"]:
            store.verify(name)

    def tunings_all():
        for name in store.manifest()["tunings"]:
            store.tuning(name)

    def lookup():
        from kvbuffer.kernels import lookup as lk

        lk.clear_kernels()
        return lk.kernel_for(KEY)

    return {"manifest": store.manifest, "verify": verify_all, "tuning": tunings_all,
            "entries": ArtifactCache(root).entries, "lookup": lookup}


@pytest.fixture
def fake_gpu(monkeypatch):
    from kvbuffer import gpus
    from kvbuffer.kernels import lookup

    gpu = gpus.get_gpu("h200")
    monkeypatch.setattr(gpus, "detect_local_gpu", lambda device=0: gpu)
    monkeypatch.setattr(artifacts, "load_library", lambda path, function: (None, lambda *a: None))
    lookup.allow_jit(False)
    yield gpu
    lookup.allow_jit(None)
    lookup.clear_kernels()


def test_the_uncorrupted_cache_serves_every_reader(tmp_path, fake_gpu, monkeypatch):
    root = tmp_path / "cache"
    build(root, fake_gpu)
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(root))
    for name, read in _readers(root).items():
        read()
    assert all(r["ok"] for r in ArtifactCache(root).entries())


@BOUNDED
@given(edits=st.lists(st.tuples(st.sampled_from(tuple(CORRUPTIONS)), JSON), min_size=1, max_size=3),
       seed=st.integers(0, 2 ** 31))
def test_a_corrupted_cache_is_artifact_errors_and_clear_repairs_it(tmp_path_factory, fake_gpu, monkeypatch,
                                                                   edits, seed):
    base = tmp_path_factory.mktemp("case")
    root, victim = base / "cache", base / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (victim / "artifacts").mkdir()
    build(root, fake_gpu)
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(root))
    rng = random.Random(seed)
    for name, value in edits:
        try:
            CORRUPTIONS[name](root, rng, value)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, OSError):
            event(f"{name}: not applicable after an earlier edit")
    outside, inside = tree_digest(victim), tree_digest(root)

    for name, read in _readers(root).items():
        try:
            read()
            event(f"{name}: ok")
        except ArtifactError as e:
            event(f"{name}: ArtifactError")
            assert str(e).strip(), name
        assert tree_digest(root) == inside, f"{name} wrote into the cache"
    for args in (["cache", "ls"], ["env"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code in (0, 1) and "Traceback" not in r.output, (args, r.output)
        if r.exit_code:
            assert r.output.startswith("Error: "), r.output

    r = CliRunner().invoke(main, ["cache", "clear", "--yes"])
    assert r.exit_code == 0, r.output
    assert tree_digest(victim) == outside, "clear touched something outside the cache root"
    assert ArtifactStore(root).manifest() == empty_manifest()
    assert CliRunner().invoke(main, ["cache", "ls"]).exit_code == 0
