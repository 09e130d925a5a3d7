"""Write side of the artifact cache (layout and reading: kvbuffer.artifacts).

A writer compiles into a private staging directory with no lock held (compiles take seconds),
then takes the cache's exclusive fcntl lock, checks again whether another writer has already
published a valid artifact under the same key (flashinfer's double check), and otherwise renames
the staging directory into place with os.replace and rewrites manifest.json (temp file + fsync +
os.replace). Readers never need the lock: every file they read appears by an atomic rename.
A corrupt artifact found under a key is moved aside and replaced, never reused.
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
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Mapping

from kvbuffer.artifacts import (
    FORMAT, LIBRARY, MANIFEST, META, STATUSES, ArtifactKey, ArtifactStore, runtime_versions, sha256_file,
)
from kvbuffer.errors import ArtifactError

from .policy import merge_records


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


def _write_json(path: Path, obj) -> None:
    """Write, fsync, rename: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class ArtifactCache(ArtifactStore):
    """A cache root you can write to: publish artifacts and tuning records, set status, clear."""

    notes: tuple = ()  # what the last put_tuning's merge kept or dropped (for the CLI to show)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _staging(self, name: str) -> Path:
        path = self.root / "staging" / f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def _is_valid(self, name: str) -> bool:
        try:
            self.verify(name)
            return True
        except (ArtifactError, OSError, ValueError, KeyError):
            return False

    def _update_manifest(self, edit: Callable[[dict], None]) -> None:
        """Read-modify-write of manifest.json; call with the lock held."""
        manifest = self.manifest()
        edit(manifest)
        _write_json(self.root / MANIFEST, manifest)

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
        stage = self._staging(name)
        try:
            export(stage / LIBRARY)
            lib_sha = sha256_file(stage / LIBRARY)
            meta = {"format": FORMAT, "key": key.to_json(), "key_sha256": key.digest, "function": function,
                    "files": {LIBRARY: lib_sha}, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build": dict(info or {})}
            _write_json(stage / META, meta)
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

    def set_status(self, name: str, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        with self.lock():
            self._update_manifest(lambda m: m["artifacts"][name].__setitem__("status", status))

    # -- tuning records
    def put_tuning(self, name: str, record: Mapping, *, gpu: str, shape: Mapping, versions: Mapping) -> str:
        """Publish a tuning record, merged into the one already stored under `name`
        (kvbuffer.autotune.policy.merge_records: measured winners are never replaced by untuned ones).
        What the merge kept or dropped is in `self.notes`."""
        stage = self._staging(name)
        try:
            path = stage / f"{name}.json"
            with self.lock():
                old = self.tuning(name) if self._tuning_ok(name) else None
                merged, self.notes = merge_records(old, record)
                _write_json(path, merged)
                entry = {"status": merged["status"], "gpu": gpu, "shape": dict(shape), "versions": dict(versions),
                         "files": {f"tunings/{name}.json": sha256_file(path)}}
                final = self.tuning_path(name)
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, final)
                self._update_manifest(lambda m: m["tunings"].__setitem__(name, entry))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return name

    def _tuning_ok(self, name: str) -> bool:
        try:
            self.tuning(name)
            return True
        except (ArtifactError, OSError, ValueError):
            return False

    # -- maintenance
    def entries(self) -> list[dict]:
        """One row per artifact and tuning record, with whether its files verify."""
        manifest, rows = self.manifest(), []
        for name, e in sorted(manifest["artifacts"].items()):
            size = sum((self.root / rel).stat().st_size for rel in e["files"] if (self.root / rel).exists())
            rows.append({"type": "artifact", "name": name, "status": e["status"], "gpu": e.get("gpu"),
                         "arch": e.get("arch"), "kernel": e.get("kernel"), "bytes": size,
                         "ok": self._is_valid(name)})
        for name, e in sorted(manifest["tunings"].items()):
            rows.append({"type": "tuning", "name": name, "status": e["status"], "gpu": e.get("gpu"),
                         "arch": None, "kernel": None, "bytes": None, "ok": self._tuning_ok(name)})
        return rows

    def clear(self, gpu: str | None = None) -> int:
        """Remove every artifact and tuning record (or only those of one GPU); returns how many."""
        with self.lock():
            try:
                manifest = self.manifest()
            except ArtifactError:
                if gpu is not None:
                    raise
                return self._reset()
            gone = [("artifacts", n) for n, e in manifest["artifacts"].items() if gpu in (None, e.get("gpu"))]
            gone += [("tunings", n) for n, e in manifest["tunings"].items() if gpu in (None, e.get("gpu"))]
            for section, name in gone:
                del manifest[section][name]
            _write_json(self.root / MANIFEST, manifest)
            for section, name in gone:
                path = self.artifact_dir(name) if section == "artifacts" else self.tuning_path(name)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.exists():
                    path.unlink()
            if gpu is None:
                shutil.rmtree(self.root / "staging", ignore_errors=True)
        return len(gone)


    def _reset(self) -> int:
        """Remove everything under an unreadable manifest (call with the lock held)."""
        for sub in ("artifacts", "tunings", "staging"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        (self.root / MANIFEST).unlink(missing_ok=True)
        return 0


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
