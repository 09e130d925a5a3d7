"""Kernel bundles: a cache's artifacts and tuning records in one file, to tune once and deploy many.

`kvbuffer tune` needs TileLang, nvcc and (to measure) the GPU; a serving machine needs none of them,
only the artifacts. `export_bundle` writes a cache's entries (every one, or one GPU's) as a .tar.gz
laid out as a cache root of its own (manifest.json, artifacts/, tunings/), under the cache's lock so
that no writer changes an entry between its check and its copy; only entries whose checksums verify
go in, and a tuning record only with every artifact it names. `import_bundle` adds such a file to
another cache.

A bundle's checksums are its own: they catch damage, not tampering. Its kernels are native code that
the runtime loads, so a bundle must come from a source you trust (export prints the file's sha256;
`import --sha256` checks it before reading anything else).

An imported file is still read as if it were hostile: only regular files at the layout's own paths
(no links, no absolute or '..' names, nothing else, a size cap) are unpacked, into a staging
directory inside the target cache. That directory is then opened as a cache root, so the manifest,
every checksum, every meta.json and every tuning record pass the checks a cache read does
(kvbuffer.artifacts); an entry may list only its own files, a record may name only artifacts the
bundle holds, of its own GPU, and must merge (policy.merge_records). Any failure refuses the whole
bundle before anything is published. Publishing takes the cache's lock per entry and renames
(ArtifactCache.adopt, put_tuning): an artifact already in the cache intact is kept, a record merged.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from kvbuffer.artifacts import (CHECKED_VERSIONS, ENTRY_NAME, LIBRARY, MANIFEST, META, empty_manifest,
                                runtime_versions, sha256_file)
from kvbuffer.errors import ArtifactError
from kvbuffer.tuning import TuningStore

from .cache import ArtifactCache
from .policy import merge_records

MAX_BUNDLE_BYTES = 1 << 30  # unpacked; a cache of every preset's kernels is tens of MiB
_NAME = ENTRY_NAME.pattern
_MEMBER = re.compile(rf"{re.escape(MANIFEST)}|artifacts/{_NAME}/(?:{re.escape(LIBRARY)}|{re.escape(META)})"
                     rf"|tunings/{_NAME}\.json")
_MALFORMED = (ArtifactError, KeyError, TypeError, ValueError, AttributeError)  # what a malformed entry raises


@dataclass
class BundleReport:
    """What an export or import did, for the CLI to print."""

    artifacts: int = 0
    tunings: int = 0
    kept: int = 0              # import: artifacts the cache already had intact
    bytes: int = 0
    sha256: str = ""           # export: the bundle file's
    skipped: list = field(default_factory=list)   # export: "name: why" of entries left out
    notes: list = field(default_factory=list)     # import: version mismatches, merge notes


# ----------------------------------------------------------------------------------------------
# export


def export_bundle(cache: ArtifactCache, dest: str | os.PathLike, gpu: str | None = None) -> BundleReport:
    """Write the cache's valid entries (only `gpu`'s, if given) to the .tar.gz `dest`, atomically."""
    dest = Path(dest)
    if dest.is_dir():
        raise ArtifactError(f"{dest} is a directory; name the bundle file to write, e.g. {dest / 'kernels.tar.gz'}")
    if not cache.manifest()["artifacts"]:
        raise _nothing(cache, gpu)
    report = BundleReport()
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        with cache.lock():  # no writer replaces an entry between its check and its copy
            chosen = _exportable(cache, gpu, report)
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as raw:
                with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                    for section in ("artifacts", "tunings"):
                        for entry in chosen[section].values():
                            for rel in entry["files"]:
                                report.bytes += _add_file(tar, cache.inside(rel, "export"), rel)
                    _add_bytes(tar, MANIFEST, json.dumps(chosen, indent=1, sort_keys=True).encode())
                raw.flush()
                os.fsync(raw.fileno())
        os.replace(tmp, dest)
    except OSError as e:
        raise ArtifactError(f"cannot write the bundle {dest}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    report.artifacts, report.tunings = len(chosen["artifacts"]), len(chosen["tunings"])
    report.sha256 = sha256_file(dest)
    return report


def _exportable(cache: TuningStore, gpu: str | None, report: BundleReport) -> dict:
    """The manifest of what to export: entries that verify, records whose artifacts all go too."""
    manifest, out = cache.manifest(), empty_manifest()
    for name, entry in sorted(manifest["artifacts"].items()):
        if gpu in (None, entry.get("gpu")):
            try:
                cache.verify(name, manifest)
                out["artifacts"][name] = entry
            except (ArtifactError, OSError) as e:
                report.skipped.append(f"{name}: {e}")
    for name, entry in sorted(manifest["tunings"].items()):
        if gpu in (None, entry.get("gpu")):
            try:
                record = cache.tuning(name, manifest)
            except (ArtifactError, OSError) as e:
                report.skipped.append(f"{name}: {e}")
                continue
            missing = sorted({w["artifact"] for w in record["winners"]} - set(out["artifacts"]))
            if missing:
                report.skipped.append(f"{name}: its artifact {missing[0]} is not exported (corrupt or missing)")
            else:
                out["tunings"][name] = entry
    if not out["artifacts"] and not out["tunings"]:
        raise _nothing(cache, gpu)
    return out


def _nothing(cache: TuningStore, gpu: str | None) -> ArtifactError:
    return ArtifactError(f"nothing to export from {cache.root}{f' for {gpu}' if gpu else ''}; build kernels "
                         "with `kvbuffer tune` first")


def _add_file(tar: tarfile.TarFile, path: Path, arcname: str) -> int:
    """path's bytes as a plain file member (never a link, whatever the cache holds); returns its size."""
    with open(path, "rb") as f:
        info = tarfile.TarInfo(arcname)
        info.size, info.mode = os.fstat(f.fileno()).st_size, 0o644
        tar.addfile(info, f)
    return info.size


def _add_bytes(tar: tarfile.TarFile, arcname: str, data: bytes) -> None:
    info = tarfile.TarInfo(arcname)
    info.size, info.mode = len(data), 0o644
    tar.addfile(info, io.BytesIO(data))


# ----------------------------------------------------------------------------------------------
# import


def import_bundle(cache: ArtifactCache, src: str | os.PathLike, sha256: str | None = None) -> BundleReport:
    """Add the bundle file `src` (export_bundle's) to the cache; `sha256`: the digest it must have.
    See the module docstring for what is checked before anything is published."""
    src = Path(src)
    if not src.is_file():
        raise ArtifactError(f"no bundle file {src}")
    actual = sha256_file(src) if sha256 is not None else None
    if actual is not None and actual != sha256.lower():
        raise ArtifactError(f"bundle {src} has sha256 {actual}, not the {sha256} it was given; nothing was imported")
    stage = cache.staging("import")
    try:
        _unpack(src, stage, cache)
        bundle = TuningStore(stage)
        try:
            manifest, metas, records, notes = _checked(bundle)
        except _MALFORMED as e:  # the reader's words, without its advice about clearing a cache
            problem = (str(e).split("; ")[0] if isinstance(e, ArtifactError) else f"{type(e).__name__}: {e}")
            raise ArtifactError(f"bundle {src} failed its checks, nothing was imported: "
                                f"{problem.replace(str(stage), src.name)}") from None
        report = BundleReport(artifacts=len(metas), tunings=len(records), notes=notes)
        published = 0
        try:
            for name in metas:
                if not cache.adopt(bundle, name, manifest["artifacts"][name]["status"]):
                    report.kept += 1
                published += 1
            for name, record in records.items():
                entry = manifest["tunings"][name]
                cache.put_tuning(name, record, gpu=entry["gpu"], shape=entry["shape"], versions=entry["versions"])
                report.notes += [f"tuning record {name}: {note}" for note in cache.notes]
        except ArtifactError as e:
            raise ArtifactError(f"import of {src} stopped after {published} of {len(metas)} artifacts: {e}; "
                                "run it again (what is published stays valid)") from None
        return report
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _unpack(src: Path, stage: Path, cache: ArtifactCache) -> None:
    """The bundle's layout files into `stage`: regular files at known paths only, size-capped."""
    total = 0
    try:
        tar = tarfile.open(src, "r:*")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArtifactError(f"bundle {src} is not a readable .tar.gz ({type(e).__name__}: {e})") from None
    with tar:
        while True:
            try:
                member = tar.next()
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ArtifactError(f"bundle {src} is damaged ({type(e).__name__}: {e})") from None
            if member is None:
                break
            if member.isdir():
                continue
            if not member.isfile() or not _MEMBER.fullmatch(member.name):
                why = "not a regular file" if not member.isfile() else "not a cache path"
                raise ArtifactError(f"bundle {src}: unexpected member {member.name!r} ({why}); only files "
                                    "written by `kvbuffer cache export` are imported")
            total += member.size
            if total > MAX_BUNDLE_BYTES:
                raise ArtifactError(f"bundle {src}: more than {MAX_BUNDLE_BYTES >> 30} GiB unpacked")
            path = stage / member.name
            if path.exists():
                raise ArtifactError(f"bundle {src}: {member.name} appears twice")
            try:
                data = tar.extractfile(member)
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ArtifactError(f"bundle {src} is damaged ({type(e).__name__}: {e})") from None
            _write_member(data, path, src, cache)
    if not (stage / MANIFEST).is_file():
        raise ArtifactError(f"bundle {src} has no {MANIFEST}; only files written by `kvbuffer cache export` "
                            "are imported")


def _write_member(data, path: Path, src: Path, cache: ArtifactCache) -> None:
    """One member's bytes to `path`: a read error is the bundle's fault, a write error the cache's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with data, open(path, "wb") as out:
        while True:
            try:
                chunk = data.read(1 << 20)
            except (tarfile.TarError, EOFError, OSError) as e:
                raise ArtifactError(f"bundle {src} is damaged ({type(e).__name__}: {e})") from None
            if not chunk:
                return
            try:
                out.write(chunk)
            except OSError as e:
                raise cache.unwritable(e) from None


def _checked(bundle: TuningStore):
    """(manifest, metas, records, version notes) of an unpacked bundle, or the first thing wrong with it.
    The cheap structural checks come before any file is hashed."""
    manifest = bundle.manifest()  # manifest_problem: every name and field
    for section in ("artifacts", "tunings"):
        for name, entry in manifest[section].items():
            if set(entry["files"]) != set(_own_files(section, name)):
                raise ArtifactError(f"{section[:-1]} {name} lists files other than its own "
                                    f"{_own_files(section, name)}")
    metas = {name: bundle.verify(name, manifest) for name in manifest["artifacts"]}
    records = {name: bundle.tuning(name, manifest) for name in manifest["tunings"]}
    for name, record in records.items():
        merge_records(record, record)  # every field a merge into the target's record reads
        for w in record["winners"]:
            if w["artifact"] not in metas:
                raise ArtifactError(f"tuning record {name} names {w['artifact']}, which the bundle does not hold")
            if metas[w["artifact"]]["key"]["gpu"] != manifest["tunings"][name]["gpu"]:
                raise ArtifactError(f"tuning record {name} is filed under GPU {manifest['tunings'][name]['gpu']!r} "
                                    f"but names {w['artifact']}, built for {metas[w['artifact']]['key']['gpu']!r}")
    return manifest, metas, records, _version_notes(metas.values())


def _own_files(section: str, name: str) -> list[str]:
    """The files an entry of the layout consists of (a manifest may list no others for it)."""
    if section == "artifacts":
        return [f"artifacts/{name}/{LIBRARY}", f"artifacts/{name}/{META}"]
    return [f"tunings/{name}.json"]


def _version_notes(metas) -> list[str]:
    """One line per set of versions (kvbuffer, TileLang, the templates' digest) the bundle's kernels were
    built with that this process does not have (the runtime looks kernels up under its own versions
    only). A library not installed here is not compared: a serving machine may run TileLang's runtime
    without its wheel."""
    have = runtime_versions()
    seen = {tuple((lib, m["key"]["versions"].get(lib)) for lib in CHECKED_VERSIONS) for m in metas}
    notes = []
    for built in sorted(seen, key=str):
        differ = [f"{lib} {v or 'unrecorded'} (this machine: {have[lib]})" for lib, v in built
                  if have[lib] not in (None, v)]
        if differ:
            notes.append("some kernels were built with " + ", ".join(differ) + "; this kvbuffer will not use them")
    return notes
