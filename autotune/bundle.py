"""Kernel bundles: a cache's artifacts and tuning records in one file, to tune once and deploy many.

`kvbuffer tune` needs TileLang, nvcc and (to measure) the GPU; a serving machine needs none of them,
only the artifacts. `export_bundle` writes a cache's entries (every one, or one GPU's) as a .tar.gz
laid out as a cache root of its own (manifest.json, artifacts/, tunings/); `import_bundle` adds such
a file to another cache. Only entries whose checksums verify are exported, and a tuning record only
with every artifact it names.

An imported file is treated as hostile until proven otherwise: only regular files at the layout's
own paths are read from it (no links, no absolute or '..' paths, a size cap), into a staging
directory inside the target cache; that directory is then opened as a cache root, so the manifest,
every checksum, every meta.json and every tuning record pass the same checks a cache read does
(kvbuffer.artifacts) before anything is published. Publishing takes the cache's lock and renames
(ArtifactCache.adopt, put_tuning): an artifact already in the cache is kept, a record is merged.
Nothing outside the cache root and the named bundle file is written.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvbuffer.artifacts import (CHECKED_VERSIONS, LIBRARY, MANIFEST, META, ArtifactStore, empty_manifest,
                                runtime_versions)
from kvbuffer.errors import ArtifactError

from .cache import ArtifactCache, write_json

MAX_BUNDLE_BYTES = 8 << 30  # unpacked; a cache of every preset's kernels is tens of MiB
_ENTRY = r"[A-Za-z0-9][A-Za-z0-9._+=-]*"  # what artifacts.safe_name produces
_MEMBER = re.compile(rf"{MANIFEST}|artifacts/{_ENTRY}/(?:{LIBRARY}|{META})|tunings/{_ENTRY}\.json")


@dataclass
class BundleReport:
    """What an export or import did, for the CLI to print."""

    artifacts: int = 0
    tunings: int = 0
    kept: int = 0              # import: artifacts the cache already had
    bytes: int = 0
    skipped: list = field(default_factory=list)   # "name: why" of entries left out
    notes: list = field(default_factory=list)     # version mismatches, merge notes


def export_bundle(cache: ArtifactStore, dest: str | os.PathLike, gpu: str | None = None) -> BundleReport:
    """Write the cache's valid entries (only `gpu`'s, if given) to the .tar.gz `dest`, atomically."""
    dest = Path(dest)
    if dest.is_dir():
        raise ArtifactError(f"{dest} is a directory; name the bundle file to write, e.g. {dest / 'kernels.tar.gz'}")
    manifest, report = cache.manifest(), BundleReport()
    out = empty_manifest()
    for name, entry in sorted(manifest["artifacts"].items()):
        if gpu not in (None, entry.get("gpu")):
            continue
        try:
            cache.verify(name)
        except (ArtifactError, OSError) as e:
            report.skipped.append(f"{name}: {e}")
            continue
        out["artifacts"][name] = entry
    for name, entry in sorted(manifest["tunings"].items()):
        if gpu not in (None, entry.get("gpu")):
            continue
        try:
            record = cache.tuning(name)
        except (ArtifactError, OSError) as e:
            report.skipped.append(f"{name}: {e}")
            continue
        missing = sorted({w["artifact"] for w in record["winners"]} - set(out["artifacts"]))
        if missing:
            report.skipped.append(f"{name}: its artifact {missing[0]} is not exported (corrupt or missing)")
            continue
        out["tunings"][name] = entry
    if not out["artifacts"] and not out["tunings"]:
        raise ArtifactError(f"nothing to export from {cache.root}"
                            f"{f' for {gpu}' if gpu else ''}; build kernels with `kvbuffer tune` first")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tmp, "w:gz") as tar:
            for section in ("artifacts", "tunings"):
                for entry in out[section].values():
                    for rel in entry["files"]:
                        report.bytes += _add_file(tar, cache.inside(rel, "export"), rel)
            manifest_tmp = tmp.with_name(tmp.name + ".manifest")
            write_json(manifest_tmp, out)
            _add_file(tar, manifest_tmp, MANIFEST)
        os.replace(tmp, dest)
    except OSError as e:
        raise ArtifactError(f"cannot write the bundle {dest}: {e.strerror or e}") from None
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".manifest")):
            leftover.unlink(missing_ok=True)
    report.artifacts, report.tunings = len(out["artifacts"]), len(out["tunings"])
    return report


def import_bundle(cache: ArtifactCache, src: str | os.PathLike) -> BundleReport:
    """Add the bundle file `src` (export_bundle's) to the cache; see the module docstring."""
    src = Path(src)
    stage = cache.staging(f"import-{safe_stem(src)}")
    try:
        _unpack(src, stage)
        bundle = ArtifactStore(stage)
        try:
            manifest = bundle.manifest()  # manifest_problem: every name and field checked
            metas = {name: bundle.verify(name) for name in manifest["artifacts"]}
            records = {name: bundle.tuning(name) for name in manifest["tunings"]}
        except ArtifactError as e:  # the reader's text, without its advice about clearing a cache
            problem = str(e).split("; ")[0].replace(f"{stage}/", f"{src.name}:")
            raise ArtifactError(f"bundle {src} failed its checks, nothing was imported: {problem}") from None
        for section, names in (("artifacts", metas), ("tunings", records)):
            for name in names:
                if set(manifest[section][name]["files"]) != set(_own_files(section, name)):
                    raise ArtifactError(f"bundle {src}: {section[:-1]} {name} lists files other than its own "
                                        f"{_own_files(section, name)}; nothing was imported")
        for name, record in records.items():
            missing = sorted({w["artifact"] for w in record["winners"]} - set(metas))
            if missing:
                raise ArtifactError(f"bundle {src}: tuning record {name} names {missing[0]}, which the bundle "
                                    "does not hold; nothing was imported")
        report = BundleReport(notes=_version_notes(metas.values()))
        for name in metas:
            if not cache.adopt(bundle, name, manifest["artifacts"][name]["status"]):
                report.kept += 1
        for name, record in records.items():
            entry = manifest["tunings"][name]
            cache.put_tuning(name, record, gpu=entry.get("gpu"), shape=entry["shape"], versions=entry["versions"])
            report.notes += list(cache.notes)
        report.artifacts, report.tunings = len(metas), len(records)
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _own_files(section: str, name: str) -> list[str]:
    """The files an entry of the layout consists of (a manifest may list no others for it)."""
    if section == "artifacts":
        return [f"artifacts/{name}/{LIBRARY}", f"artifacts/{name}/{META}"]
    return [f"tunings/{name}.json"]


def _add_file(tar: tarfile.TarFile, path: Path, arcname: str) -> int:
    """path's bytes as a plain file member (never a link, whatever the cache holds); returns its size."""
    with open(path, "rb") as f:
        info = tarfile.TarInfo(arcname)
        info.size, info.mode, info.mtime = os.fstat(f.fileno()).st_size, 0o644, int(os.fstat(f.fileno()).st_mtime)
        tar.addfile(info, f)
    return info.size


def safe_stem(path: Path) -> str:
    """A staging-name-safe form of a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[:60] or "bundle"


def _unpack(src: Path, stage: Path) -> None:
    """The bundle's layout files into `stage`: regular files at known paths only, size-capped."""
    total = 0
    try:
        with tarfile.open(src, "r:*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                if not member.isfile() or not _MEMBER.fullmatch(member.name):
                    raise ArtifactError(f"bundle {src}: unexpected member {member.name!r} "
                                        f"({'not a regular file' if not member.isfile() else 'not a cache path'}); "
                                        "only files written by `kvbuffer cache export` are imported")
                total += member.size
                if total > MAX_BUNDLE_BYTES:
                    raise ArtifactError(f"bundle {src}: more than {MAX_BUNDLE_BYTES >> 30} GiB unpacked")
                path = stage / member.name
                if path.exists():
                    raise ArtifactError(f"bundle {src}: {member.name} appears twice")
                path.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as f, open(path, "wb") as out:
                    shutil.copyfileobj(f, out)
    except FileNotFoundError:
        raise ArtifactError(f"no bundle file {src}") from None
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"bundle {src} is not a readable .tar.gz ({type(e).__name__}: {e})") from None
    if not (stage / MANIFEST).is_file():
        raise ArtifactError(f"bundle {src} has no {MANIFEST}; only files written by `kvbuffer cache export` "
                            "are imported")


def _version_notes(metas) -> list[str]:
    """One line per kvbuffer / TileLang version set the bundle's kernels were built with that this
    process does not have (the runtime looks kernels up under its own versions only)."""
    have = runtime_versions()
    seen = {tuple((lib, m["key"]["versions"].get(lib)) for lib in CHECKED_VERSIONS) for m in metas}
    notes = []
    for built in sorted(seen, key=str):
        differ = [f"{lib} {v} (this machine: {have[lib]})" for lib, v in built
                  if have[lib] is not None and v != have[lib]]
        if differ:
            notes.append("some kernels were built with " + ", ".join(differ) + "; this kvbuffer will not use them")
    return notes
