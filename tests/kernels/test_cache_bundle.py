"""`kvbuffer cache export` / `import`: a cache's kernels moved to another cache intact, checked before
anything is published, and hostile or damaged bundles refused with one error that leaves the target
cache (and everything outside it) as it was."""

import io
import json
import tarfile
from pathlib import Path

import pytest

from kvbuffer.artifacts import ArtifactStore, runtime_versions
from kvbuffer.autotune.bundle import export_bundle, import_bundle
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.errors import ArtifactError

from tests.kernels.test_artifacts import SHAPE, make_key, put
from tests.kernels.test_cache_hardening import root  # noqa: F401 (fixture: the import's target cache)
from tests.kernels.test_cache_hardening import cli, one_error_line, record_for, sentinel_intact, winner


@pytest.fixture
def tuned(tmp_path) -> ArtifactCache:
    """A source cache: two artifacts of one GPU, one of another, a tuning record naming the first."""
    cache = ArtifactCache(tmp_path / "src")
    a = put(cache, make_key(), status="tuned")
    put(cache, make_key(chunk_size=8))
    put(cache, make_key(gpu="h100"))
    cache.put_tuning("t", record_for([winner("gdn_flush", a, 16)]), gpu="h200", shape=SHAPE,
                     versions=runtime_versions())
    return cache


def entries(cache: ArtifactStore) -> dict:
    m = cache.manifest()
    return {s: {n: (e["status"], e["files"]) for n, e in m[s].items()} for s in ("artifacts", "tunings")}


def test_export_then_import_gives_the_same_verified_entries(tuned, root, tmp_path):
    bundle = tmp_path / "out" / "kernels.tar.gz"
    report = export_bundle(tuned, bundle)
    assert (report.artifacts, report.tunings, report.skipped) == (3, 1, [])
    dest = ArtifactCache(root)
    got = import_bundle(dest, bundle)
    assert (got.artifacts, got.tunings, got.kept, got.notes) == (3, 1, 0, [])
    assert entries(dest) == entries(tuned)
    for name in dest.manifest()["artifacts"]:
        dest.verify(name)
    assert dest.tuning("t") == tuned.tuning("t")
    assert not any((root / "staging").iterdir())  # the unpacked bundle is gone
    assert [p.name for p in bundle.parent.iterdir()] == ["kernels.tar.gz"]  # no temp files left
    assert sentinel_intact(root)


def test_export_of_one_gpu_and_import_twice_keeps_what_is_there(tuned, root, tmp_path):
    bundle = tmp_path / "h100.tar.gz"
    assert export_bundle(tuned, bundle, gpu="h100").artifacts == 1
    dest = ArtifactCache(root)
    import_bundle(dest, bundle)
    again = import_bundle(dest, bundle)
    assert (again.artifacts, again.kept) == (1, 1)
    assert {e["gpu"] for e in dest.manifest()["artifacts"].values()} == {"h100"}


def test_import_raises_an_untuned_artifact_to_tuned_and_never_lowers(tuned, root, tmp_path):
    dest = ArtifactCache(root)
    name = put(dest, make_key())  # untuned here, tuned in the bundle
    export_bundle(tuned, tmp_path / "b.tar.gz")
    import_bundle(dest, tmp_path / "b.tar.gz")
    assert dest.status(name) == "tuned"


def test_corrupt_entries_are_left_out_of_an_export_and_named(tuned, tmp_path):
    name = next(n for n, e in tuned.manifest()["artifacts"].items() if e["status"] == "tuned")
    lib = tuned.artifact_dir(name) / "kernel.so"
    lib.write_bytes(lib.read_bytes()[:100])  # truncated
    report = export_bundle(tuned, tmp_path / "b.tar.gz")
    assert report.artifacts == 2 and report.tunings == 0  # the record names the corrupt artifact
    assert any(s.startswith(name) and "checksum" in s for s in report.skipped)
    assert any(s.startswith("t:") for s in report.skipped)


def test_export_of_an_empty_cache_or_to_a_directory_is_one_error(tmp_path):
    with pytest.raises(ArtifactError, match="nothing to export"):
        export_bundle(ArtifactCache(tmp_path / "empty"), tmp_path / "b.tar.gz")
    with pytest.raises(ArtifactError, match="is a directory"):
        export_bundle(ArtifactCache(tmp_path / "empty"), tmp_path)


def _bundle_with(path: Path, members: dict, links: dict | None = None) -> Path:
    """A .tar.gz of `members` (name: bytes) and of special members (name: (tar type, link target))."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, (kind, to) in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, to
            tar.addfile(info)
    return path


def _members(bundle: Path) -> dict:
    with tarfile.open(bundle) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


HOSTILE = {
    "dotdot": ({"manifest.json": b"{}", "../victim/precious.txt": b"gone"}, None, "not a cache path"),
    "absolute": ({"manifest.json": b"{}", "/tmp/x": b"x"}, None, "not a cache path"),
    "stray file": ({"manifest.json": b"{}", "artifacts/a/run.sh": b"rm -rf /"}, None, "not a cache path"),
    "symlink": ({"manifest.json": b"{}"}, {"artifacts/a/kernel.so": (tarfile.SYMTYPE, "/etc/passwd")},
                "not a regular file"),
    "hardlink": ({"manifest.json": b"{}"}, {"artifacts/a/kernel.so": (tarfile.LNKTYPE, "manifest.json")},
                 "not a regular file"),
    "fifo": ({"manifest.json": b"{}"}, {"artifacts/a/kernel.so": (tarfile.FIFOTYPE, "")}, "not a regular file"),
    "dot path": ({"manifest.json": b"{}", "./manifest.json": b"{}"}, None, "not a cache path"),
    "lookalike": ({"manifestXjson": b"{}"}, None, "not a cache path"),
    "no manifest": ({"tunings/t.json": b"{}"}, None, "has no manifest.json"),
    "bad manifest": ({"manifest.json": b"[1]"}, None, "not an object"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_bundles_are_refused_before_anything_is_written(case, root, tmp_path):
    members, links, text = HOSTILE[case]
    dest = ArtifactCache(root)
    with pytest.raises(ArtifactError, match=text):
        import_bundle(dest, _bundle_with(tmp_path / "b.tar.gz", members, links))
    assert entries(dest) == {"artifacts": {}, "tunings": {}}
    assert not any((root / "staging").iterdir())
    assert sentinel_intact(root)


def test_an_altered_file_in_a_bundle_is_refused_whole(tuned, root, tmp_path):
    good = tmp_path / "good.tar.gz"
    export_bundle(tuned, good)
    members = _members(good)
    lib = next(n for n in members if n.endswith("kernel.so"))
    members[lib] = members[lib][:-1] + b"!"
    dest = ArtifactCache(root)
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        import_bundle(dest, _bundle_with(tmp_path / "bad.tar.gz", members))
    assert entries(dest) == {"artifacts": {}, "tunings": {}}  # not even the intact artifacts


def test_a_record_without_its_artifact_is_refused(tuned, root, tmp_path):
    good = tmp_path / "good.tar.gz"
    export_bundle(tuned, good)
    members = _members(good)
    manifest = json.loads(members["manifest.json"])
    gone = tuned.tuning("t")["winners"][0]["artifact"]
    del manifest["artifacts"][gone]
    members = {n: d for n, d in members.items() if f"/{gone}/" not in n}
    members["manifest.json"] = json.dumps(manifest).encode()
    with pytest.raises(ArtifactError, match="does not hold"):
        import_bundle(ArtifactCache(root), _bundle_with(tmp_path / "bad.tar.gz", members))


def test_not_a_bundle_and_a_missing_file_are_one_error_each(root, tmp_path):
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(ArtifactError, match="not a readable"):
        import_bundle(ArtifactCache(root), tmp_path / "junk.tar.gz")
    with pytest.raises(ArtifactError, match="no bundle file"):
        import_bundle(ArtifactCache(root), tmp_path / "missing.tar.gz")


def test_kernels_of_other_versions_import_with_a_note(tmp_path, root):
    src = ArtifactCache(tmp_path / "src")
    put(src, make_key(versions={**runtime_versions(), "kvbuffer": "0.0.1"}))
    export_bundle(src, tmp_path / "b.tar.gz")
    report = import_bundle(ArtifactCache(root), tmp_path / "b.tar.gz")
    assert report.artifacts == 1
    assert len(report.notes) == 1 and "kvbuffer 0.0.1" in report.notes[0] and "will not use" in report.notes[0]


def test_cli_round_trip_and_one_line_errors(tuned, root, tmp_path):
    bundle = str(tmp_path / "k.tar.gz")
    out = cli("cache", "export", bundle, "--cache-dir", str(tuned.root))
    assert out.exit_code == 0, out.output
    assert "exported 3 artifacts and 1 tuning record" in out.output
    out = cli("cache", "import", bundle, "--cache-dir", str(root))
    assert out.exit_code == 0, out.output
    assert f"imported 3 artifacts and 1 tuning record" in out.output and str(root) in out.output
    one_error_line(cli("cache", "import", str(tmp_path / "missing.tar.gz"), "--cache-dir", str(root)),
                   "no bundle file")
    one_error_line(cli("cache", "export", bundle, "--cache-dir", str(tmp_path / "empty")), "nothing to export")


def _tampered(tuned, tmp_path: Path, edit) -> Path:
    """tuned's export with edit(members, manifest) applied (manifest: the parsed manifest.json)."""
    good = tmp_path / "good.tar.gz"
    export_bundle(tuned, good)
    members = _members(good)
    manifest = json.loads(members["manifest.json"])
    edit(members, manifest)
    members["manifest.json"] = json.dumps(manifest).encode()
    return _bundle_with(tmp_path / "bad.tar.gz", members)


def _rewrite_record(members: dict, manifest: dict, change) -> None:
    """Change tuning record t and keep its checksum consistent (so only the change can be refused)."""
    import hashlib

    record = json.loads(members["tunings/t.json"])
    change(record)
    members["tunings/t.json"] = json.dumps(record).encode()
    manifest["tunings"]["t"]["files"]["tunings/t.json"] = hashlib.sha256(members["tunings/t.json"]).hexdigest()


def _rewrite_meta(members: dict, manifest: dict, change) -> None:
    """Change the meta.json of the record's artifact, checksum kept consistent."""
    import hashlib

    rel = next(n for n in members if n.endswith("meta.json"))
    meta = json.loads(members[rel])
    change(meta)
    members[rel] = json.dumps(meta).encode()
    name = rel.split("/")[1]
    manifest["artifacts"][name]["files"][rel] = hashlib.sha256(members[rel]).hexdigest()


def _first_artifact(manifest: dict) -> str:
    return sorted(manifest["artifacts"])[0]


TAMPERED = {
    # a record the checks pass but a merge cannot read: refused before publishing, not halfway through
    "record without medians": (lambda m, man: _rewrite_record(m, man, lambda r: [w.pop("median_us")
                                                                              for w in r["winners"]]),
                               "KeyError"),
    "key shape not an object": (lambda m, man: _rewrite_meta(m, man, lambda meta: meta["key"].__setitem__(
        "shape", [1, 2])), "failed its checks"),
    "a NUL in a path": (lambda m, man: man["artifacts"][_first_artifact(man)]["files"].__setitem__(
        "artifacts/x\x00y", "0" * 64), "lists files other than its own"),
    "files of another entry": (lambda m, man: man["artifacts"][_first_artifact(man)]["files"].__setitem__(
        "tunings/t.json", man["tunings"]["t"]["files"]["tunings/t.json"]), "lists files other than its own"),
    "record filed under another GPU": (lambda m, man: man["tunings"]["t"].__setitem__("gpu", "b200"),
                                       "filed under GPU 'b200'"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_tampered_bundles_are_refused_whole_with_one_error(case, tuned, root, tmp_path):
    edit, text = TAMPERED[case]
    dest = ArtifactCache(root)
    with pytest.raises(ArtifactError, match=text) as err:
        import_bundle(dest, _tampered(tuned, tmp_path, edit))
    assert "nothing was imported" in str(err.value)
    assert entries(dest) == {"artifacts": {}, "tunings": {}}
    assert not any((root / "staging").iterdir())


def test_the_exported_sha256_is_checked_first_when_given(tuned, root, tmp_path):
    bundle = tmp_path / "b.tar.gz"
    digest = export_bundle(tuned, bundle).sha256
    with pytest.raises(ArtifactError, match="not the"):
        import_bundle(ArtifactCache(root), bundle, sha256="0" * 64)
    assert import_bundle(ArtifactCache(root), bundle, sha256=digest.upper()).artifacts == 3


def test_a_missing_bundle_leaves_no_directory_behind(root, tmp_path):
    with pytest.raises(ArtifactError, match="no bundle file"):
        import_bundle(ArtifactCache(root), tmp_path / "missing.tar.gz")
    assert not root.exists()


def test_a_bundle_past_the_size_cap_is_refused(tuned, root, tmp_path, monkeypatch):
    from kvbuffer.autotune import bundle

    export_bundle(tuned, tmp_path / "b.tar.gz")
    monkeypatch.setattr(bundle, "MAX_BUNDLE_BYTES", 1 << 10)
    with pytest.raises(ArtifactError, match="unpacked"):
        import_bundle(ArtifactCache(root), tmp_path / "b.tar.gz")
    assert not any((root / "staging").iterdir())
