"""Write side of the artifact cache (layout and reading: kvbuffer.artifacts).

A writer compiles into a private staging directory with no lock held (compiles take seconds),
then takes the cache's exclusive fcntl lock, checks again whether another writer has already
published a valid artifact under the same key (flashinfer's double check), and otherwise renames
the staging directory into place with os.replace and rewrites manifest.json (temp file + fsync +
os.replace). Readers never need the lock: every file they read appears by an atomic rename.
A corrupt artifact found under a key is moved aside and replaced, never reused.

`clear` takes the same lock, so it never runs between a tune's publish steps; a tuning record is
published only if every artifact it names is still in the manifest (a clear between two of a
tune's artifacts makes that tune fail instead of leaving a record that points at nothing). A
staging directory whose owner process is gone (a killed tune), or older than STALE_STAGING_S, is
removed by `clear`; one a live writer is still building in is kept. Every path removed is one
kvbuffer.artifacts resolved inside the cache root and named as kvbuffer names its files (ENTRY_NAME,
STAGING_NAME, TEMP_NAME): another program's file next to them is never touched; a symlink is
unlinked, never followed. Every writer first recognises the folder as kvbuffer's and marks it
(ArtifactStore.mark): another program's folder is refused before anything is written.

`prune` removes what an interrupted or superseded tune left: the artifacts no tuning record names
(a re-tune's or a template change's old builds, an interrupted tune's last group, whose record was
never written), artifact directories and record files the manifest does not list, and abandoned
staging directories. It takes the same lock. A tune marks itself in staging/ while it runs
(`tune_running`), since it publishes a group's record after its artifacts: prune keeps the unnamed
artifacts built since a running tune began, and removes the rest whatever their age unless told to
keep younger ones (`older_than_s`). `prunable` says what prune would remove, for `cache ls`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Mapping

from kvbuffer.artifacts import (
    ENTRY_NAME, FORMAT, LIBRARY, MANIFEST, META, STAGING_NAME, STATUSES, TEMP_NAME, ArtifactKey, ArtifactStore,
    empty_manifest, runtime_versions, sha256_file,
)
from kvbuffer.errors import ArtifactError
from kvbuffer.tuning import TuningStore

from .policy import merge_records

STALE_STAGING_S = 24 * 3600  # a build takes seconds to minutes; a staging dir this old is abandoned
TUNE_MARK = "tune-running"  # staging/<TUNE_MARK>.<pid>.<random>: a tune in progress, since the dir's mtime


@dataclass
class PrunePlan:
    """What `prune` removes (artifacts: unnamed ones, with their bytes; orphans: paths under artifacts/
    and tunings/ the manifest does not list; staging: abandoned staging dirs) and what it keeps."""

    artifacts: list = field(default_factory=list)
    bytes: int = 0
    orphans: list = field(default_factory=list)
    staging: list = field(default_factory=list)
    kept_running: int = 0   # unnamed artifacts built since a running tune began
    kept_young: int = 0     # unnamed artifacts younger than the age asked for


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's live process (or a number no process has)
    return True


def _remove(path: Path) -> None:
    """Delete a file, a symlink (the link itself) or a directory tree that does not follow links."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


@lru_cache(maxsize=None)
def nvcc_version() -> str | None:
    """'13.0.88' from `nvcc --version` (None without nvcc): part of every artifact key."""
    nvcc = os.environ.get("CUDA_HOME") and Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
    exe = str(nvcc) if nvcc and nvcc.exists() else shutil.which("nvcc")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def build_versions() -> dict:
    """The versions an artifact compiled in this process depends on (kvbuffer, TileLang, CUDA)."""
    return {**runtime_versions(), "cuda": nvcc_version()}


def write_json(path: Path, obj) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ArtifactCache(TuningStore):
    """A cache root you can write to: publish artifacts and tuning records, set status, clear."""

    notes: tuple = ()  # what the last put_tuning's merge kept or dropped (for the CLI to show)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The cache's exclusive writer lock (tune's publish steps and clear). Refuses a folder that is
        not kvbuffer's cache, and marks a new or recognised one (ArtifactStore.mark)."""
        try:
            self.mark()
            f = open(self.root / ".lock", "a")
        except OSError as e:
            raise self.unwritable(e) from None
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def unwritable(self, e: OSError) -> ArtifactError:
        """The error for a write into this cache that the file system refused (read-only, full, ...)."""
        return ArtifactError(f"cannot write the kernel cache at {self.root}: {e.strerror} "
                             f"({e.filename or self.root}); pass --cache-dir or set KVBUFFER_CACHE_DIR to a "
                             "writable directory")

    def staging(self, name: str) -> Path:
        """A new private directory under staging/ (writers build there, then rename into place)."""
        path = self.root / "staging" / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir(parents=True)
        except OSError as e:
            raise self.unwritable(e) from None
        return path

    @contextlib.contextmanager
    def tune_running(self) -> Iterator[None]:
        """Mark a tune in progress (prune keeps what it builds) until exit; also checks that the cache
        can be written before anything is built."""
        mark = self.staging(TUNE_MARK)
        try:
            with self.lock():
                pass
            yield
        finally:
            _remove(mark)

    def running_tunes(self) -> list[tuple[int, float]]:
        """(pid, start time) of each tune marked running whose process is alive."""
        staging, out = self.root / "staging", []
        if staging.is_symlink() or not staging.is_dir():
            return out
        for path in staging.glob(f"{TUNE_MARK}.*"):
            owner = STAGING_NAME.fullmatch(path.name)
            try:
                started = path.lstat().st_mtime
            except OSError:
                continue
            if owner is not None and _pid_alive(int(owner.group(1))):
                out.append((int(owner.group(1)), started))
        return out

    def remove_own_staging(self) -> int:
        """Remove this process's staging dirs but its tune mark (an interrupted build's); returns how many."""
        staging, n = self.root / "staging", 0
        if staging.is_symlink() or not staging.is_dir():
            return 0
        for path in staging.iterdir():
            owner = STAGING_NAME.fullmatch(path.name)
            if owner is not None and int(owner.group(1)) == os.getpid() and not path.name.startswith(TUNE_MARK):
                _remove(path)
                n += 1
        return n

    def _is_valid(self, name: str, manifest: dict | None = None) -> bool:
        try:
            self.verify(name, manifest)
            return True
        except (ArtifactError, OSError, ValueError, KeyError):
            return False

    def _update_manifest(self, edit: Callable[[dict], None]) -> None:
        """Read-modify-write of manifest.json; call with the lock held."""
        manifest = self.manifest()
        edit(manifest)
        self._write_manifest(manifest)

    def _write_manifest(self, manifest: dict) -> None:
        try:
            write_json(self.root / MANIFEST, manifest)
        except OSError as e:
            raise self.unwritable(e) from None

    def _move_aside(self, path: Path) -> None:
        if path.exists():
            trash = self.root / "staging" / f"corrupt-{path.name}.{uuid.uuid4().hex[:8]}"
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    # -- artifacts
    def has(self, key: ArtifactKey) -> bool:
        """A valid (checksummed) artifact exists for this key."""
        return self._is_valid(key.name)

    def put(self, key: ArtifactKey, export: Callable[[Path], None], *, function: str,
            status: str = "untuned", info: Mapping | None = None) -> str:
        """Publish the library `export(path)` writes under `key`; returns the artifact name.

        If a valid artifact already exists (another writer won the race) it is kept and the new
        build is discarded; its status is only ever raised (untuned -> tuned), never lowered.
        """
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        name = key.name
        stage = self.staging(name)
        try:
            export(stage / LIBRARY)
            lib_sha = sha256_file(stage / LIBRARY)
            meta = {"format": FORMAT, "key": key.to_json(), "key_sha256": key.digest, "function": function,
                    "files": {LIBRARY: lib_sha}, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build": dict(info or {})}
            write_json(stage / META, meta)
            files = {f"artifacts/{name}/{LIBRARY}": lib_sha, f"artifacts/{name}/{META}": sha256_file(stage / META)}
            with self.lock():
                final = self.artifact_dir(name)
                if self._is_valid(name):
                    files = None  # double check: someone published it while we compiled
                else:
                    self._move_aside(final)
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(stage, final)
                self._update_manifest(lambda m: _record_artifact(m, key, files, status))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return name

    def adopt(self, source: ArtifactStore, name: str, status: str) -> bool:
        """Publish artifact `name` of another cache root on this file system (an unpacked bundle in
        staging/, already verified) by renaming its directory into place. Returns False if a valid
        artifact of that name was here already: it is kept, its status only raised, as `put` does."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        key = ArtifactKey.from_json(source.verify(name)["key"])
        files = dict(source.manifest()["artifacts"][name]["files"])
        with self.lock():
            if self._is_valid(name):
                self._update_manifest(lambda m: _record_artifact(m, key, None, status))
                return False
            final = self.artifact_dir(name)
            self._move_aside(final)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(source.artifact_dir(name), final)
            self._update_manifest(lambda m: _record_artifact(m, key, files, status))
        return True

    def set_status(self, name: str, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        with self.lock():
            self.status(name)  # an ArtifactError if there is no such artifact
            self._update_manifest(lambda m: m["artifacts"][name].__setitem__("status", status))

    # -- tuning records
    def put_tuning(self, name: str, record: Mapping, *, gpu: str, shape: Mapping, versions: Mapping) -> str:
        """Publish a tuning record, merged into the one already stored under `name`
        (kvbuffer.autotune.policy.merge_records: measured winners are never replaced by untuned ones).
        What the merge kept or dropped is in `self.notes`."""
        stage = self.staging(name)
        try:
            path = stage / f"{name}.json"
            with self.lock():
                old = self.tuning(name) if self._tuning_ok(name) else None
                merged, self.notes = merge_records(old, record)
                self._check_winners_published(name, merged)
                write_json(path, merged)
                entry = {"status": merged["status"], "gpu": gpu, "shape": dict(shape), "versions": dict(versions),
                         "files": {f"tunings/{name}.json": sha256_file(path)}}
                final = self.tuning_path(name)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, final)
                self._update_manifest(lambda m: m["tunings"].__setitem__(name, entry))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return name

    def _check_winners_published(self, name: str, record: Mapping) -> None:
        """Every artifact a record names must be in the manifest now (with the lock held): a `cache
        clear` that ran while this tune compiled removed what the record would point at."""
        artifacts = self.manifest()["artifacts"]
        gone = sorted({w["artifact"] for w in record["winners"]} - set(artifacts))
        if gone:
            raise ArtifactError(f"tuning record {name} not published: {len(gone)} of its artifacts "
                                f"({gone[0]}, ...) are no longer in {self.root} (was `kvbuffer cache clear` "
                                "run during this tune?); run the tune again")

    def _tuning_ok(self, name: str) -> bool:
        try:
            self.tuning(name)
            return True
        except (ArtifactError, OSError, ValueError):
            return False

    # -- maintenance
    def entries(self) -> list[dict]:
        """One row per artifact and tuning record, with whether its files verify and, for an artifact,
        whether a tuning record names it (`used`; None where a record cannot be read). Each record is
        read once."""
        manifest, rows = self.manifest(), []
        records = self._read_records(manifest)
        named = None if any(isinstance(r, str) for r in records.values()) else _named(records)
        for name, e in sorted(manifest["artifacts"].items()):
            size = sum(self._size(rel) for rel in e["files"])
            rows.append({"type": "artifact", "name": name, "status": e["status"], "gpu": e.get("gpu"),
                         "arch": e.get("arch"), "kernel": e.get("kernel"), "bytes": size,
                         "ok": self._is_valid(name, manifest), "used": None if named is None else name in named})
        for name, e in sorted(manifest["tunings"].items()):
            rows.append({"type": "tuning", "name": name, "status": e["status"], "gpu": e.get("gpu"),
                         "arch": None, "kernel": None, "bytes": None, "ok": isinstance(records[name], dict)})
        return rows

    def _size(self, rel: str) -> int:
        try:
            return self.inside(rel, "size").stat().st_size
        except (ArtifactError, OSError):
            return 0

    def clear(self, gpu: str | None = None, stale_after: float = STALE_STAGING_S) -> int:
        """Remove every artifact and tuning record (or only those of one GPU) and abandoned staging
        directories; returns how many entries. An invalid manifest is replaced by an empty one (with
        everything under artifacts/ and tunings/: nothing it names can be trusted)."""
        with self.lock():
            self._clean_staging(stale_after)
            try:
                manifest = self.manifest()
            except ArtifactError:
                if gpu is not None:
                    raise
                return self._reset()
            gone = [("artifacts", n) for n, e in manifest["artifacts"].items() if gpu in (None, e.get("gpu"))]
            gone += [("tunings", n) for n, e in manifest["tunings"].items() if gpu in (None, e.get("gpu"))]
            self._drop(manifest, gone)
        return len(gone)

    def prunable(self, older_than_s: float = 0.0, manifest: dict | None = None) -> PrunePlan:
        """What `prune(older_than_s)` would remove now. A tuning record that cannot be read is an
        ArtifactError: what it names is unknown."""
        manifest = self.manifest() if manifest is None else manifest
        records = self._read_records(manifest)
        bad = next(((name, why) for name, why in records.items() if isinstance(why, str)), None)
        if bad is not None:
            raise ArtifactError(f"tuning record {bad[0]} cannot be read ({bad[1]}), so the artifacts it names "
                                "are unknown and nothing was pruned; `kvbuffer cache clear` empties the cache")
        named, now, plan = _named(records), time.time(), PrunePlan()
        running = min((started for _, started in self.running_tunes()), default=None)
        for name, entry in manifest["artifacts"].items():
            if name in named:
                continue
            built = self._built_at(name)
            if running is not None and built >= running - 1:
                plan.kept_running += 1
            elif now - built < older_than_s:
                plan.kept_young += 1
            else:
                plan.artifacts.append(name)
                plan.bytes += sum(self._size(rel) for rel in entry["files"])
        plan.orphans = self._orphans(manifest)
        plan.staging = self._abandoned_staging(STALE_STAGING_S)
        return plan

    def prune(self, older_than_s: float = 0.0) -> PrunePlan:
        """Remove what `prunable(older_than_s)` lists, under the lock; returns that plan. Nothing is
        removed when a tuning record cannot be read."""
        with self.lock():
            manifest = self.manifest()
            plan = self.prunable(older_than_s, manifest)
            for path in plan.staging + plan.orphans:
                _remove(path)
            if plan.artifacts:
                self._drop(manifest, [("artifacts", name) for name in plan.artifacts])
        return plan

    def _orphans(self, manifest: dict) -> list[Path]:
        """Paths under artifacts/ and tunings/ that no manifest entry owns (a publish cut short between
        its rename and its manifest write), and write_json temp files of dead writers in the root."""
        out = [p for p in _children(self.root / "artifacts")
               if ENTRY_NAME.fullmatch(p.name) and p.name not in manifest["artifacts"]]
        out += [p for p in _children(self.root / "tunings")
                if p.name.endswith(".json") and ENTRY_NAME.fullmatch(p.name[:-5]) and p.name[:-5] not in manifest["tunings"]]
        for p in _children(self.root):
            owner = TEMP_NAME.fullmatch(p.name)
            if owner is not None and not _pid_alive(int(owner.group(1))):
                out.append(p)
        return out

    def _drop(self, manifest: dict, gone: list[tuple[str, str]]) -> None:
        """Remove (section, name) entries from the manifest, write it, then delete their files (call
        with the lock held). Names are checked by the manifest: one component under the root."""
        for section, name in gone:
            del manifest[section][name]
        self._write_manifest(manifest)
        for section, name in gone:
            _remove(self.artifact_dir(name) if section == "artifacts" else self.tuning_path(name))

    def _read_records(self, manifest: dict) -> dict:
        """Each tuning record of the manifest, read and checked once: name -> the record, or the first
        line of why it cannot be read."""
        out = {}
        for name in manifest["tunings"]:
            try:
                out[name] = self.tuning(name, manifest)
            except (ArtifactError, OSError, ValueError) as e:
                out[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return out

    def _built_at(self, name: str) -> float:
        """When artifact `name` was published (its directory's mtime; 0 if it is gone)."""
        try:
            return self.artifact_dir(name).lstat().st_mtime
        except OSError:
            return 0.0

    def _abandoned_staging(self, stale_after: float) -> list[Path]:
        """Staging dirs whose writer is gone or that are older than `stale_after` seconds (a staging/
        that is not a plain directory, itself)."""
        staging = self.root / "staging"
        if staging.is_symlink() or (staging.exists() and not staging.is_dir()):
            return [staging]
        now, out = time.time(), []
        for path in _children(staging):
            owner = STAGING_NAME.fullmatch(path.name)
            if owner is None:
                continue  # not a name kvbuffer gives: not kvbuffer's to remove
            try:
                age = now - path.lstat().st_mtime
            except OSError:
                continue
            if not _pid_alive(int(owner.group(1))) or age > stale_after:
                out.append(path)
        return out

    def _clean_staging(self, stale_after: float) -> None:
        """Remove staging dirs whose writer is gone or that are older than `stale_after` seconds."""
        for path in self._abandoned_staging(stale_after):
            _remove(path)

    def _reset(self) -> int:
        """Replace an invalid manifest by an empty one, with every entry under artifacts/ and tunings/
        (kvbuffer's names only; call with the lock held)."""
        for p in _children(self.root / "artifacts"):
            if ENTRY_NAME.fullmatch(p.name):
                _remove(p)
        for p in _children(self.root / "tunings"):
            if p.name.endswith(".json") and ENTRY_NAME.fullmatch(p.name[:-5]):
                _remove(p)
        for sub in ("artifacts", "tunings"):  # gone when nothing else was in them
            if not (self.root / sub).is_symlink():
                with contextlib.suppress(OSError):
                    (self.root / sub).rmdir()
        _remove(self.root / MANIFEST)
        self._write_manifest(empty_manifest())
        return 0


def _children(path: Path) -> list[Path]:
    """The entries of a real directory (none for a missing one or a link)."""
    if path.is_symlink() or not path.is_dir():
        return []
    return sorted(path.iterdir())


def _named(records: dict) -> set[str]:
    """The artifacts the winners of readable tuning records name."""
    return {w["artifact"] for r in records.values() if isinstance(r, dict) for w in r["winners"]}


def _record_artifact(manifest: dict, key: ArtifactKey, files: dict | None, status: str) -> None:
    entry = manifest["artifacts"].get(key.name)
    if files is None and entry is not None:  # kept the other writer's build: only raise its status
        if status == "tuned":
            entry["status"] = "tuned"
        return
    if entry is not None and entry["status"] == "tuned":
        status = "tuned"
    manifest["artifacts"][key.name] = {"status": status, "gpu": key.gpu, "arch": key.arch,
                                       "kernel": key.kernel, "key_sha256": key.digest, "files": files}
