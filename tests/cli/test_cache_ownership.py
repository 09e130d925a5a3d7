"""The cache commands touch only kvbuffer's own cache: a folder without kvbuffer's marker that is
not provably a kvbuffer cache (another program's manifest.json, files kvbuffer never writes) is
refused by `cache ls`, `clear`, `prune` and `import` alike, with one error line that suggests
nothing destructive, and every byte of it is left as it was. A cache from before the marker is
recognised by its manifest and marked by the first command that writes. `cache ls` reads under
the lock, so a clear or import in another process never shows as CORRUPT entries."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbuffer.artifacts import MARKER, ArtifactStore
from kvbuffer.autotune.cache import ArtifactCache
from kvbuffer.cli.main import main
from kvbuffer.errors import ArtifactError

from tests.kernels.test_artifacts import make_key, put

ROOT = Path(__file__).resolve().parents[2]


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree(root: Path) -> dict:
    """Every file under root (links as their targets) -> its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        out[key] = ("link", os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return out


def _other_programs(root: Path) -> None:
    (root / "artifacts" / "model").mkdir(parents=True)
    (root / "artifacts" / "model" / "weights.bin").write_bytes(b"\x00\x01" * 100)
    (root / "tunings").mkdir()
    (root / "tunings" / "notes.json").write_text('{"mine": true}')
    (root / "staging").mkdir()
    (root / "staging" / "mywork.txt").write_text("half done")
    (root / "manifest.json").write_text(json.dumps({"version": 3, "files": ["artifacts/model/weights.bin"]}))


def _kvbuffer_shaped_with_extra_key(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"format": 1, "artifacts": {}, "tunings": {}, "owner": "me"}))


def _kvbuffer_manifest_and_a_stranger(root: Path) -> None:
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"format": 1, "artifacts": {}, "tunings": {}}))
    (root / "staging").mkdir()
    (root / "staging" / "mywork.txt").write_text("mine")


def _no_manifest(root: Path) -> None:
    (root / "photos").mkdir(parents=True)
    (root / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    (root / "readme.txt").write_text("hello")


FOREIGN = {"another program's manifest": _other_programs, "kvbuffer-shaped but an extra key":
           _kvbuffer_shaped_with_extra_key, "kvbuffer's manifest next to a stranger": _kvbuffer_manifest_and_a_stranger,
           "no manifest, other files": _no_manifest}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    put(ArtifactCache(src / "cache"), make_key())
    out = src / "kernels.tar.gz"
    assert cli("cache", "export", out, "--cache-dir", src / "cache").exit_code == 0
    return out


@pytest.mark.parametrize("make", FOREIGN.values(), ids=list(FOREIGN))
@pytest.mark.parametrize("command", ["ls", "clear", "prune", "import"])
def test_a_foreign_folder_is_refused_and_left_as_it_was(tmp_path, bundle, make, command):
    root = tmp_path / "theirs"
    make(root)
    before = tree(root)
    args = {"ls": ["ls"], "clear": ["clear", "--yes"], "prune": ["prune"], "import": ["import", bundle]}[command]
    r = cli("cache", *args, "--cache-dir", root)
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "is not a kvbuffer kernel cache" in errors[0], r.output
    assert "clear" not in r.output and "prune" not in r.output.replace(str(root), "")
    assert tree(root) == before


def test_the_runtime_never_reads_a_foreign_folder(tmp_path):
    root = tmp_path / "theirs"
    _other_programs(root)
    with pytest.raises(ArtifactError, match="not a kvbuffer kernel cache") as e:
        ArtifactStore(root).manifest()
    assert "cache clear" not in str(e.value)


def test_a_cache_from_before_the_marker_is_listed_and_marked_by_the_first_write(tmp_path):
    root = tmp_path / "cache"
    put(ArtifactCache(root), make_key())
    (root / MARKER).unlink(missing_ok=True)  # as an older kvbuffer left it
    assert ArtifactStore(root).ownership() == "proven"
    r = cli("cache", "ls", "--cache-dir", root)
    assert r.exit_code == 0 and "ok" in r.output and not (root / MARKER).exists(), r.output  # ls writes nothing
    assert cli("cache", "prune", "--cache-dir", root).exit_code == 0
    assert ArtifactStore(root).ownership() == "marked"


@pytest.mark.parametrize("exists", [False, True], ids=["missing", "empty"])
def test_a_new_or_empty_folder_becomes_a_marked_cache(tmp_path, exists):
    root = tmp_path / "new"
    if exists:
        root.mkdir()
    assert ArtifactStore(root).ownership() == "new"
    assert cli("cache", "ls", "--cache-dir", root).exit_code == 0
    assert cli("cache", "clear", "--yes", "--cache-dir", root).exit_code == 0
    assert ArtifactStore(root).ownership() == "marked"


def test_a_marked_cache_whose_manifest_is_damaged_is_still_kvbuffers(tmp_path):
    root = tmp_path / "cache"
    put(ArtifactCache(root), make_key())
    ArtifactStore(root).mark()
    (root / "manifest.json").write_text("{}")
    r = cli("cache", "ls", "--cache-dir", root)
    assert r.exit_code == 1 and "cache manifest" in r.output and "cache clear" in r.output, r.output
    assert cli("cache", "clear", "--yes", "--cache-dir", root).exit_code == 0
    assert cli("cache", "ls", "--cache-dir", root).exit_code == 0


@pytest.mark.parametrize("command", [["clear", "--yes"], ["prune"]], ids=["clear", "prune"])
def test_foreign_files_inside_kvbuffers_cache_survive(tmp_path, command):
    root = tmp_path / "cache"
    put(ArtifactCache(root), make_key())
    ArtifactStore(root).mark()
    (root / "staging" / "mywork.txt").write_text("mine")
    (root / "tunings").mkdir(exist_ok=True)
    (root / "tunings" / "readme.md").write_text("mine")
    (root / "notes.txt").write_text("mine")
    assert cli("cache", *command, "--cache-dir", root).exit_code == 0
    assert all((root / p).read_text() == "mine" for p in ("staging/mywork.txt", "tunings/readme.md", "notes.txt"))


_CHURN = """
import sys, time
from kvbuffer.autotune.bundle import import_bundle
from kvbuffer.autotune.cache import ArtifactCache
root, bundle, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
store = ArtifactCache(root)
while time.time() < until:
    import_bundle(store, bundle, None)
    store.clear()
"""


def test_ls_never_reports_corrupt_entries_while_another_process_clears_and_imports(tmp_path):
    src = tmp_path / "src"
    cache = ArtifactCache(src)
    for i in range(12):
        put(cache, make_key(source=f"template {i}"))
    bundle = tmp_path / "many.tar.gz"
    assert cli("cache", "export", bundle, "--cache-dir", src).exit_code == 0
    root = tmp_path / "cache"
    assert cli("cache", "import", bundle, "--cache-dir", root).exit_code == 0
    until = time.time() + 6
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    churn = subprocess.Popen([sys.executable, "-c", _CHURN, str(root), str(bundle), str(until)], env=env)
    try:
        listings = 0
        while time.time() < until:
            r = cli("cache", "ls", "--json", "--cache-dir", root)
            assert r.exit_code == 0, r.output
            rows = [json.loads(line) for line in r.output.splitlines()]
            assert all(row["ok"] for row in rows), [row["name"] for row in rows if not row["ok"]]
            listings += 1
    finally:
        churn.wait(timeout=60)
    assert churn.returncode == 0 and listings > 3
