"""The compiled-artifact cache: stable keys, checksummed manifest, rejected corrupt / stale / foreign
artifacts, concurrent writers, and a real TileLang export loaded without TileLang."""

import importlib.util
import json
import multiprocessing
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbuffer.artifacts import LIBRARY, META, ArtifactKey, ArtifactStore, embedded_cubin_sms, runtime_versions
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.tuning import ChunkPolicy, TuningStore, select, tuning_name
from kvbuffer.errors import ArtifactError
from tests.support.tuning_records import empty_record

HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None and shutil.which("nvcc") is not None
needs_tilelang = pytest.mark.skipif(not HAVE_TILELANG, reason="needs TileLang and nvcc to compile")
SHAPE = {"family": "gdn", "Hk": 16, "Hv": 32, "K": 128, "V": 128, "dtype": "bfloat16"}


def make_key(**changes) -> ArtifactKey:
    fields = dict(gpu="h200", arch="sm_90a", kernel="gdn_flush", shape=dict(SHAPE), chunk_size=16,
                  tunables={"BV": 32, "threads": 128},
                  versions={**runtime_versions(), "cuda": "13.0.88"}, source="abc")
    fields.update(changes)
    return ArtifactKey(**fields)


def fake_cubin(sm: int) -> bytes:
    """A CUDA ELF header as TileLang's export embeds it (ELF ABI 8: SM in e_flags bits 8-15)."""
    hdr = bytearray(64)
    hdr[0:4], hdr[4], hdr[8] = b"\x7fELF", 2, 8
    struct.pack_into("<H", hdr, 18, 190)
    struct.pack_into("<I", hdr, 48, (sm << 8) | 0x02)
    return bytes(hdr)


def fake_export(sm: int = 90, delay: float = 0.0):
    def export(path: Path) -> None:
        time.sleep(delay)
        path.write_bytes(b"\x7fELF host library stand-in " + b"x" * 4000 + fake_cubin(sm) + b"y" * 100)
    return export


def put(cache: ArtifactCache, key: ArtifactKey, sm: int = 90, **kw) -> str:
    return cache.put(key, fake_export(sm), function="gdn_flush_rows", **kw)


# ----------------------------------------------------------------------------------------------
# keys


def test_key_is_stable_and_ignores_dict_order():
    a = make_key()
    b = make_key(shape=dict(reversed(list(SHAPE.items()))), tunables={"threads": 128, "BV": 32})
    assert a.digest == b.digest and a.name == b.name
    assert a.name.startswith("gdn_flush_h200_sm_90a_gdn_hk16_hv32_k128_v128_bf16_c16_bv32_threads128-")
    assert a.name.endswith(a.digest[:16])


@pytest.mark.parametrize("change", [
    {"gpu": "h100"}, {"arch": "sm_100a"}, {"kernel": "gdn_recurrent"}, {"shape": {**SHAPE, "Hv": 48}},
    {"shape": {**SHAPE, "dtype": "float16"}}, {"chunk_size": 8}, {"tunables": {"BV": 64, "threads": 128}},
    {"versions": {**runtime_versions(), "cuda": "12.8.1"}}, {"versions": {**runtime_versions(), "cuda": "13.0.88",
                                                                          "tilelang": "0.1.14"}},
    {"source": "abd"},
], ids=lambda c: next(iter(c)) + ("-" + str(next(iter(c.values()))) if isinstance(next(iter(c.values())), str) else ""))
def test_any_changed_field_changes_the_key(change):
    assert make_key(**change).digest != make_key().digest
    assert make_key(**change).name != make_key().name


def test_key_rejects_values_that_are_not_plain_json():
    with pytest.raises(TypeError, match="tunables.BV"):
        _ = make_key(tunables={"BV": (32, 64)}).digest


# ----------------------------------------------------------------------------------------------
# write, verify, reject


def test_put_writes_files_and_manifest_with_checksums(tmp_path):
    cache = ArtifactCache(tmp_path)
    name = put(cache, make_key())
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    entry = manifest["artifacts"][name]
    assert entry["status"] == "untuned" and entry["arch"] == "sm_90a"
    assert set(entry["files"]) == {f"artifacts/{name}/{LIBRARY}", f"artifacts/{name}/{META}"}
    meta = cache.verify(name)
    assert ArtifactKey.from_json(meta["key"]) == make_key()
    assert embedded_cubin_sms(tmp_path / "artifacts" / name / LIBRARY) == {90}
    assert not list((tmp_path / "staging").iterdir())


def test_status_only_goes_up(tmp_path):
    cache = ArtifactCache(tmp_path)
    name = put(cache, make_key())
    put(cache, make_key(), status="tuned")
    assert cache.status(name) == "tuned"
    put(cache, make_key(), status="untuned")
    assert cache.status(name) == "tuned"


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[:1000])


def _flip(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _edit_meta(p: Path):
    meta = json.loads(p.read_text())
    meta["function"] = "something_else"
    p.write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, file, why", [
    (_truncate, LIBRARY, "checksum mismatch"), (_flip, LIBRARY, "checksum mismatch"),
    (Path.unlink, LIBRARY, "missing"), (_edit_meta, META, "checksum mismatch"),
], ids=["truncate", "flip-byte", "delete", "edit-meta"])
def test_damaged_artifact_is_rejected_and_names_the_rebuild(tmp_path, damage, file, why):
    cache = ArtifactCache(tmp_path)
    name = put(cache, make_key())
    damage(tmp_path / "artifacts" / name / file)
    with pytest.raises(ArtifactError, match=why) as e:
        ArtifactStore(tmp_path).load(name, arch=None)
    assert "kvbuffer tune --gpu" in str(e.value)
    assert not cache.has(make_key())
    assert [r["ok"] for r in cache.entries()] == [False]


def test_damaged_artifact_is_replaced_on_rebuild(tmp_path):
    cache = ArtifactCache(tmp_path)
    name = put(cache, make_key())
    _truncate(tmp_path / "artifacts" / name / LIBRARY)
    assert put(cache, make_key()) == name
    cache.verify(name)


def test_other_kvbuffer_version_is_rejected(tmp_path):
    key = make_key(versions={**runtime_versions(), "kvbuffer": "0.0.1", "cuda": "13.0.88"})
    name = put(ArtifactCache(tmp_path), key)
    with pytest.raises(ArtifactError, match=r"built with kvbuffer 0\.0\.1, this process has kvbuffer") as e:
        ArtifactStore(tmp_path).load(name, arch=None)
    assert "kvbuffer tune --gpu h200 --heads 16,32,128,128" in str(e.value)


def test_other_tilelang_version_is_rejected(tmp_path):
    name = put(ArtifactCache(tmp_path), make_key(versions={**runtime_versions(), "tilelang": "0.1.9"}))
    with pytest.raises(ArtifactError, match=r"built with tilelang 0\.1\.9"):
        ArtifactStore(tmp_path).load(name, arch=None)


def test_artifacts_of_edited_templates_are_rejected(tmp_path):
    """An artifact built from other template sources (same kvbuffer and TileLang versions) never loads."""
    name = put(ArtifactCache(tmp_path), make_key(versions={**runtime_versions(), "templates": "0" * 16}))
    with pytest.raises(ArtifactError, match=r"built with templates 0{16}, this process has templates [0-9a-f]{16}"):
        ArtifactStore(tmp_path).load(name, arch=None)


def test_templates_digest_follows_the_template_sources(tmp_path, monkeypatch):
    """The digest covers each template file and each runtime module they import, by content."""
    import shutil

    from kvbuffer import artifacts

    package = tmp_path / "tiles_copy"
    shutil.copytree(Path(__file__).resolve().parents[2] / "tiles", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(artifacts, "TEMPLATE_PACKAGE", "tiles_copy")
    artifacts.templates_digest.cache_clear()
    try:
        before = artifacts.templates_digest()
        (package / "conv1d.py").write_text((package / "conv1d.py").read_text() + "\n# an edit\n")
        artifacts.templates_digest.cache_clear()
        assert artifacts.templates_digest() != before
    finally:
        artifacts.templates_digest.cache_clear()


def test_templates_digest_names_an_uninstalled_template_package(monkeypatch):
    from kvbuffer import artifacts

    monkeypatch.setattr(artifacts, "TEMPLATE_PACKAGE", "kvbuffer_no_such_tiles")
    artifacts.templates_digest.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"kvbuffer_no_such_tiles is not importable: install kvbuffer"):
            artifacts.templates_digest()
    finally:
        artifacts.templates_digest.cache_clear()


def test_wrong_arch_is_rejected(tmp_path):
    name = put(ArtifactCache(tmp_path), make_key(gpu="a100", arch="sm_80"), sm=80)
    with pytest.raises(ArtifactError, match=r"built for sm_80 \(a100\), this GPU is sm_90a \(h200\)") as e:
        ArtifactStore(tmp_path).load(name, arch="sm_90a", gpu="h200")
    assert "kvbuffer tune --gpu h200" in str(e.value)


def test_cubin_of_another_arch_than_its_meta_is_rejected(tmp_path):
    name = put(ArtifactCache(tmp_path), make_key(), sm=80)  # meta says sm_90a, the binary is sm_80
    with pytest.raises(ArtifactError, match="embedded cubin is sm_80"):
        ArtifactStore(tmp_path).load(name, arch="sm_90a")


def test_tuning_record_from_other_versions_is_rejected_clearly(tmp_path):
    cache = ArtifactCache(tmp_path)
    old = {"kvbuffer": "0.0.1", "tilelang": runtime_versions()["tilelang"]}
    name = tuning_name("h200", "sm_90a", SHAPE, old)
    cache.put_tuning(name, empty_record(), gpu="h200", shape=SHAPE, versions=old)
    with pytest.raises(ArtifactError, match=r"exist for \{'kvbuffer': '0.0.1'"):
        TuningStore(tmp_path).find_tuning("h200", "sm_90a", SHAPE)
    with pytest.raises(ArtifactError, match="no kernels built for h100"):
        TuningStore(tmp_path).find_tuning("h100", "sm_90a", SHAPE)


def test_tuning_record_of_edited_templates_is_not_used(tmp_path):
    """A record tuned before a template edit names artifacts of the old source: the runtime asks for a
    rebuild instead of loading them."""
    cache = ArtifactCache(tmp_path)
    stale = {**runtime_versions(), "templates": "0" * 16}
    cache.put_tuning(tuning_name("h200", "sm_90a", SHAPE, stale), empty_record(), gpu="h200", shape=SHAPE,
                     versions=stale)
    with pytest.raises(ArtifactError, match=r"'templates': '0{16}'.*kvbuffer tune --gpu h200"):
        TuningStore(tmp_path).find_tuning("h200", "sm_90a", SHAPE)


def test_cache_dir_resolution(tmp_path, monkeypatch):
    from kvbuffer.artifacts import cache_dir

    monkeypatch.delenv("KVBUFFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvbuffer"
    monkeypatch.setenv("KVBUFFER_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "flag") == tmp_path / "flag"


# ----------------------------------------------------------------------------------------------
# concurrency


def _writer(root: str, index: int) -> None:
    cache = ArtifactCache(root)
    put_ = lambda key: cache.put(key, fake_export(delay=0.05), function="f")  # noqa: E731
    put_(make_key())                                   # everyone races for the same key
    put_(make_key(chunk_size=100 + index))             # and each writes one of its own
    cache.put_tuning(f"t{index % 2}", dict(empty_record(), i=index), gpu="h200", shape=SHAPE, versions={})


def test_concurrent_writers_leave_a_consistent_cache(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    cache = ArtifactCache(tmp_path)
    names = {make_key().name} | {make_key(chunk_size=100 + i).name for i in range(4)}
    assert set(cache.manifest()["artifacts"]) == names
    assert set(cache.manifest()["tunings"]) == {"t0", "t1"}
    assert all(r["ok"] for r in cache.entries())
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == sorted(names)
    assert not list((tmp_path / "staging").iterdir())


# ----------------------------------------------------------------------------------------------
# policy


def test_chunk_policy_buckets_and_choice():
    timings = {(1, 8): 3.0, (1, 16): 2.0, (64, 8): 1.0, (64, 16): 1.5, (1024, 8): 5.0, (1024, 16): 5.0}
    policy = ChunkPolicy.from_timings(timings)
    assert policy.status == "tuned"
    assert [policy.chunk_for(b) for b in (1, 2, 64, 65, 1024, 5000)] == [16, 8, 8, 8, 8, 8]
    assert ChunkPolicy.from_json(policy.to_json()) == policy
    with pytest.raises(ValueError, match="batch must be >= 1"):
        policy.chunk_for(0)
    assert ChunkPolicy.default([1, 16], [32, 8, 16]).chunk_sizes == (16, 16)


def test_chunk_policy_says_up_to_which_batch_the_recurrent_step_won():
    """unbuffered_rows: the buckets, from the smallest, where the recurrent step beat the buffered one
    at its chosen C; a later bucket it wins again does not count (batches in between would run buffered)."""
    timings = {(1, 8): 3.0, (1, 16): 2.0, (16, 16): 4.0, (64, 16): 8.0, (256, 16): 20.0}
    policy = ChunkPolicy.from_timings(timings, {1: 1.5, 16: 3.9, 64: 9.0, 256: 10.0})
    assert policy.unbuffered_rows == 16
    assert ChunkPolicy.from_json(policy.to_json()) == policy
    assert ChunkPolicy.from_timings(timings, {1: 2.5, 16: 1.0}).unbuffered_rows == 0
    assert ChunkPolicy.from_timings(timings, {16: 1.0}).unbuffered_rows is None  # one row not timed: unknown
    no_one = {k: t for k, t in timings.items() if k[0] != 1}
    assert ChunkPolicy.from_timings(no_one, {16: 1.0, 64: 1.0}).unbuffered_rows is None
    assert ChunkPolicy.from_timings(timings).unbuffered_rows is None
    assert "unbuffered_rows" not in ChunkPolicy.from_timings(timings).to_json()  # older records read alike
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="unbuffered_rows"):
            ChunkPolicy((1,), (8,), "tuned", bad)


def test_select_takes_the_bucket_winner():
    record = {"chunk_policy": ChunkPolicy((1, 64), (16, 8), "tuned").to_json(), "winners": [
        {"kernel": "k", "batch_bucket": 1, "chunk_size": 16, "artifact": "a"},
        {"kernel": "k", "batch_bucket": 64, "chunk_size": 8, "artifact": "b"},
        {"kernel": "r", "batch_bucket": 64, "chunk_size": 0, "artifact": "c"}]}
    assert select(record, "k", 1) == ("a", 16)
    assert select(record, "k", 40) == ("b", 8)
    assert select(record, "r", 40) == ("c", 8)
    with pytest.raises(KeyError):
        select(record, "k", 40, chunk_size=32)


# ----------------------------------------------------------------------------------------------
# import hygiene


def test_runtime_and_cache_modules_do_not_import_tilelang():
    code = ("import sys, kvbuffer, kvbuffer.artifacts, kvbuffer.autotune.cache, kvbuffer.gpus, "
            "kvbuffer.autotune.policy, kvbuffer.autotune.registry, kvbuffer.cli.main; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------------------------
# a real TileLang export, loaded in a fresh process that cannot import TileLang

TOY = '''
import tilelang.language as T

def toy_scale():
    n = T.dynamic("n")

    @T.prim_func
    def toy_scale_add(x: T.Tensor((n,), "float32"), y: T.Tensor((n,), "float32")):
        with T.Kernel(T.ceildiv(n, 128), threads=128) as bx:
            for i in T.Parallel(128):
                if bx * 128 + i < n:
                    y[bx * 128 + i] = x[bx * 128 + i] * 2.0 + 1.0

    return toy_scale_add
'''

LOAD_BLOCKED = '''
import sys
sys.modules["tilelang"] = None  # any import of TileLang now fails
from kvbuffer.artifacts import ArtifactStore
art = ArtifactStore(sys.argv[1]).load(sys.argv[2], arch="sm_90a", gpu="h200")
print(type(art.fn).__name__, art.meta["function"], sorted(m for m in sys.modules if m.startswith("tvm_ffi"))[:1])
'''


@pytest.mark.tilelang
@pytest.mark.slow
@needs_tilelang
def test_exported_tilelang_kernel_loads_without_tilelang(tmp_path):
    import tilelang

    (tmp_path / "toy_tiles.py").write_text(textwrap.dedent(TOY))
    sys.path.insert(0, str(tmp_path))
    try:
        import toy_tiles
    finally:
        sys.path.remove(str(tmp_path))
    kernel = tilelang.compile(toy_tiles.toy_scale(), target={"kind": "cuda", "arch": "sm_90a"}, out_idx=None)
    cache = ArtifactCache(tmp_path / "cache")
    name = cache.put(make_key(kernel="toy_scale_add", tunables={}), lambda p: kernel.export_library(str(p)),
                     function="toy_scale_add")
    assert embedded_cubin_sms(cache.artifact_dir(name) / LIBRARY) == {90}
    out = subprocess.run([sys.executable, "-c", LOAD_BLOCKED, str(cache.root), name],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[:2] == ["Function", "toy_scale_add"]


def test_unreadable_manifest_is_an_artifact_error_and_clear_recovers(tmp_path):
    cache = ArtifactCache(tmp_path)
    name = put(cache, make_key())
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="kvbuffer cache clear"):
        ArtifactStore(tmp_path).load(name, arch=None)
    cache.clear()
    assert cache.manifest()["artifacts"] == {} and not (tmp_path / "artifacts").exists()
