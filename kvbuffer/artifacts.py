"""Compiled kernels at run time: find, verify and load artifacts; never compile, never import TileLang.

A cache root (`cache_dir()`: --cache-dir, else $KVBUFFER_CACHE_DIR, else $XDG_CACHE_HOME/kvbuffer,
else ~/.cache/kvbuffer) holds

    CACHEDIR.TAG                       kvbuffer's marker (a cache directory tag, bford.info/cachedir)
    manifest.json                      every artifact and tuning record, the sha256 of each file, status
    .lock                              writers hold it exclusively, `cache ls` shared (fcntl.flock)
    artifacts/<readable>-<hash16>/     kernel.so (TileLang `export_library`) + meta.json (key, function)
    tunings/<readable>-<hash16>.json   per GPU, head shape and versions (the templates' digest among
                                       them): the artifact to use per (kernel, batch bucket, chunk
                                       size) and the chunk-size policy
    staging/<name>.<pid>.<hex8>        writers build here, then os.replace into place

kvbuffer reads, changes or deletes only a folder it recognises as its own (`ArtifactStore.ownership`):
one with its marker; a new or empty one; or, from before the marker, one whose manifest is exactly
kvbuffer's or whose artifacts name themselves (the sha256 of the key in meta.json is in the
directory's name), with only names kvbuffer writes. Within it, only kvbuffer's own names
(ENTRY_NAME under artifacts/ and tunings/, STAGING_NAME under staging/) are ever touched.

`<hash16>` is the start of the sha256 of the artifact key as normalized JSON (sorted keys, no
spaces): GPU, arch, kernel, shapes, chunk size, tunables, template source and the versions of
TileLang, CUDA (nvcc) and kvbuffer. The compile side (kvbuffer.autotune.cache) writes this layout;
this module owns the format and is the only reader. A file whose checksum does not match the
manifest is never handed to dlopen: a truncated .so kills the loading process (SIGBUS), it does
not raise.

Loading an exported library needs apache-tvm-ffi and TileLang's `libtvm_runtime.so` (found in the
installed tilelang wheel without importing it, or at $KVBUFFER_TVM_RUNTIME); see docs/artifacts.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .errors import ArtifactError

log = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# This file is a cache directory tag created by kvbuffer: its compiled-kernel cache.\n"
               "# For information about cache directory tags, see https://bford.info/cachedir/\n")
LOCK = ".lock"
LIBRARY = "kernel.so"
META = "meta.json"
STATUSES = ("untuned", "tuned")
CHECKED_VERSIONS = ("kvbuffer", "tilelang", "templates")  # the .so ABI needs the first two (the cubin no nvcc);
# "templates" is the kernels' source: an edited template never loads its old artifacts
TEMPLATE_PACKAGE = "kvbuffer.tiles"
# runtime modules the templates use: their sources are part of the templates' digest
TEMPLATE_IMPORTS = ("kvbuffer.reference.core", "kvbuffer.reference.fp8", "kvbuffer.kernels.keys")
_JSON_SCALARS = (str, int, float, bool, type(None))
_DTYPE_ABBREV = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}


# ----------------------------------------------------------------------------------------------
# keys


def _check_json(obj: Any, where: str) -> None:
    """Keys must be plain JSON (no tuples, objects or str(repr)) so that they hash the same everywhere."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: key {k!r} must be a str")
            _check_json(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_json(v, f"{where}[{i}]")
    elif not isinstance(obj, _JSON_SCALARS):
        raise TypeError(f"{where}: {type(obj).__name__} is not a JSON scalar, list or dict")


def normalized_json(obj: Any) -> str:
    """The one serialization that keys are hashed over: sorted keys, no whitespace, ASCII."""
    _check_json(obj, "key")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(normalized_json(obj).encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def slug(mapping: Mapping[str, Any]) -> str:
    """{'family': 'gdn', 'Hk': 16, 'dtype': 'bfloat16'} -> 'gdn_hk16_bf16' (readable; the hash makes it unique)."""
    parts = [str(mapping["family"])] if "family" in mapping else []
    for k, v in sorted(mapping.items()):
        if k == "family":
            continue
        if isinstance(v, str):
            v = _DTYPE_ABBREV.get(v, v)
            parts.append(v if k.endswith("dtype") else f"{k.lower()}-{v}")
        else:
            parts.append(f"{k.lower()}{v}")
    return "_".join(parts)


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")


ENTRY_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
HASHED_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*-[0-9a-f]{16}")  # kvbuffer's entry names: readable-<hash16>
STAGING_NAME = re.compile(r".+\.(\d+)\.[0-9a-f]{8}")  # <name>.<pid>.<8 hex>: a writer's staging dir
TEMP_NAME = re.compile(r"\..+\.(\d+)\.[0-9a-f]{8}")  # .<file>.<pid>.<8 hex>: a write's temp file in the root


def check_entry_name(name: object, where: str) -> str:
    """An artifact or tuning record name as `safe_name` makes them: one path component, no leading
    dot (so never '..'). Names come from files a cache copied from another machine may have altered."""
    if not isinstance(name, str) or not ENTRY_NAME.fullmatch(name):
        raise ArtifactError(f"{where}: {name!r} is not an entry name (letters, digits, '_', '.', '-'; "
                            "no leading dot); the cache is corrupt: clear it with `kvbuffer cache clear`")
    return name


@dataclass(frozen=True)
class ArtifactKey:
    """Everything a compiled kernel depends on. Equal keys build byte-for-byte equivalent kernels."""

    gpu: str
    arch: str
    kernel: str
    shape: Mapping[str, Any]
    chunk_size: int
    tunables: Mapping[str, Any]
    versions: Mapping[str, Any]
    source: str = ""  # sha256 of the template's source file
    drafts: int = 0   # the buffer layout's speculative drafts T (C + T + 1 entries); 0: plain decoding

    def to_json(self) -> dict:
        d = {"format": FORMAT, "gpu": self.gpu, "arch": self.arch, "kernel": self.kernel,
             "shape": dict(self.shape), "chunk_size": int(self.chunk_size),
             "tunables": dict(self.tunables), "versions": dict(self.versions), "source": self.source}
        if self.drafts:  # absent for the plain layout, so keys (and names) built before drafts existed still match
            d["drafts"] = int(self.drafts)
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> "ArtifactKey":
        return cls(d["gpu"], d["arch"], d["kernel"], d["shape"], d["chunk_size"], d["tunables"],
                   d["versions"], d.get("source", ""), d.get("drafts", 0))

    @property
    def digest(self) -> str:
        return sha256_json(self.to_json())

    @property
    def name(self) -> str:
        """Readable directory name plus 16 hex digits of the key's sha256."""
        readable = f"{self.kernel}_{self.gpu}_{self.arch}_{slug(self.shape)}_c{self.chunk_size}"
        if self.drafts:
            readable += f"_d{self.drafts}"
        if self.tunables:
            readable += "_" + slug(self.tunables)
        return safe_name(readable) + "-" + self.digest[:16]


# ----------------------------------------------------------------------------------------------
# where, and which versions


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache root: explicit override, $KVBUFFER_CACHE_DIR, $XDG_CACHE_HOME/kvbuffer, ~/.cache/kvbuffer."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("KVBUFFER_CACHE_DIR"):
        return Path(os.environ["KVBUFFER_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvbuffer"


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def templates_digest() -> str:
    """sha256 over every .py file of the templates' package and the runtime modules they import (read as
    files, nothing imported): an edit to any of them gives new artifacts and retires the old ones."""
    spec = importlib.util.find_spec(TEMPLATE_PACKAGE)
    if spec is None:  # the source tree maps tiles/ to kvbuffer.tiles only when installed
        raise ImportError(f"{TEMPLATE_PACKAGE} is not importable: install kvbuffer (pip install -e .) "
                          "rather than running it from the source tree")
    package = Path(spec.origin).parent
    paths = sorted(package.glob("*.py")) + [Path(importlib.util.find_spec(m).origin) for m in TEMPLATE_IMPORTS]
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def runtime_versions() -> dict:
    """Versions this process would load artifacts with (package metadata and the templates' digest)."""
    from . import __version__

    return {"kvbuffer": __version__, "tilelang": _dist_version("tilelang"), "templates": templates_digest()[:16]}


def rebuild_hint(gpu: str | None = None, shape: Mapping | None = None, root: Path | None = None) -> str:
    cmd = f"kvbuffer tune --gpu {gpu or '<gpu>'}"
    if shape and shape.get("family") == "conv1d":  # built along with its model's linear layers
        cmd += " --model <the model>"
    elif shape and all(k in shape for k in ("Hk", "Hv", "K", "V")):
        cmd += f" --heads {shape['Hk']},{shape['Hv']},{shape['K']},{shape['V']}"
        if shape.get("family", "gdn") != "gdn":
            cmd += f" --family {shape['family']}"
        if shape.get("dtype", "bfloat16") != "bfloat16":
            cmd += f" --dtype {shape['dtype']}"
    if root is not None:
        cmd += f" --cache-dir {root}"
    return f"rebuild it with `{cmd}`"


# ----------------------------------------------------------------------------------------------
# the binary itself


def arch_number(arch: str) -> int:
    """'sm_90a' -> 90."""
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if not m:
        raise ValueError(f"not a CUDA arch: {arch!r} (expected e.g. 'sm_90a')")
    return int(m.group(1))


def embedded_cubin_sms(path: Path) -> set[int]:
    """SM numbers of the CUDA ELF images (cubins) embedded in an exported library.

    TileLang's export stores the cubin verbatim inside the .so; its ELF header (e_machine 190,
    EM_CUDA) carries the SM in e_flags: bits 8-15 for ELF ABI version >= 8 (CUDA 12.8+), bits 0-7
    before. An empty set means no cubin was found (e.g. PTX only): nothing to check.
    """
    data = Path(path).read_bytes()
    sms, i = set(), data.find(b"\x7fELF", 1)
    while i != -1 and i + 52 <= len(data):
        if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == 190:
            flags = struct.unpack_from("<I", data, i + 48)[0]
            sms.add((flags >> 8) & 0xFF if data[i + 8] >= 8 else flags & 0xFF)
        i = data.find(b"\x7fELF", i + 1)
    return sms


def tvm_runtime_path() -> Path:
    """TileLang's libtvm_runtime.so: $KVBUFFER_TVM_RUNTIME, else the installed tilelang wheel's copy.

    The wheel's files are located through package metadata; `tilelang` itself is never imported.
    """
    env = os.environ.get("KVBUFFER_TVM_RUNTIME")
    if env:
        path = Path(env)
    else:
        try:
            path = Path(importlib.metadata.distribution("tilelang").locate_file("tilelang/lib/libtvm_runtime.so"))
        except importlib.metadata.PackageNotFoundError:
            raise ArtifactError(
                "loading compiled kernels needs TileLang's libtvm_runtime.so: install the tilelang wheel "
                "(`pip install tilelang==0.1.15`; it is not imported) or set KVBUFFER_TVM_RUNTIME to the "
                "file (see docs/artifacts.md)") from None
    if not path.is_file():
        raise ArtifactError(f"TileLang runtime library not found at {path} (KVBUFFER_TVM_RUNTIME or the "
                            "tilelang wheel); see docs/artifacts.md")
    return path


@functools.lru_cache(maxsize=None)
def _load_runtime(path: str):
    """dlopen the runtime once, RTLD_GLOBAL, so that exported kernels resolve TVMBackend* and the CUDA loader."""
    import tvm_ffi  # the small, stable ABI package; not TileLang

    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    log.info("kvbuffer: loaded TVM runtime %s", path)
    return tvm_ffi


TMA_HELPER = b"__tvm_tensormap_create"


def tilelang_library_path() -> Path:
    """libtilelang.so ($KVBUFFER_TILELANG_LIB or the wheel's): only kernels whose copies use TMA need it."""
    env = os.environ.get("KVBUFFER_TILELANG_LIB")
    try:
        path = Path(env) if env else Path(importlib.metadata.distribution("tilelang").locate_file(
            "tilelang/lib/libtilelang.so"))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ArtifactError("this kernel builds TMA descriptors on the host (__tvm_tensormap_create_tiled), "
                            "which lives in TileLang's libtilelang.so: install the tilelang wheel with its "
                            "dependencies or set KVBUFFER_TILELANG_LIB; or build the template with "
                            "T.copy(..., disable_tma=True) (see docs/artifacts.md)")
    return path


def load_library(path: Path, function: str):
    """Load an exported TileLang library and return (module, function). Verify its checksum first."""
    try:
        tvm_ffi = _load_runtime(str(tvm_runtime_path()))
        if TMA_HELPER in Path(path).read_bytes():
            _load_runtime(str(tilelang_library_path()))
    except ImportError as e:
        raise ArtifactError("loading compiled kernels needs apache-tvm-ffi (`pip install "
                            "'apache-tvm-ffi>=0.1.11,<0.1.13'`); see docs/artifacts.md") from e
    module = tvm_ffi.load_module(str(path))
    try:
        return module, module.get_function(function)
    except AttributeError:
        raise ArtifactError(f"{path} has no function {function!r}") from None


# ----------------------------------------------------------------------------------------------
# reading a cache


@dataclass
class Artifact:
    """A loaded kernel: call it with every tensor (TileLang's out_idx=None ABI)."""

    name: str
    meta: dict
    path: Path
    module: Any = field(repr=False)
    fn: Any = field(repr=False)

    def __call__(self, *args):
        return self.fn(*args)

    @property
    def key(self) -> ArtifactKey:
        return ArtifactKey.from_json(self.meta["key"])


class ArtifactStore:
    """Read side of a cache root: verify checksums, check versions and arch, load."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = cache_dir(root)
        self._ours = False  # recognised once (marked or proven): it stays kvbuffer's

    # -- whose folder
    def ownership(self) -> str:
        """'marked' (kvbuffer's marker), 'new' (missing or empty) or 'proven' (from before the marker:
        a manifest exactly kvbuffer's, artifacts that name themselves, or only kvbuffer's names); an
        ArtifactError for any other folder, which kvbuffer then neither reads nor changes."""
        if self.root.exists() and not self.root.is_dir():
            raise ArtifactError(f"the kernel cache {self.root} is not a directory; pass --cache-dir or set "
                                "KVBUFFER_CACHE_DIR to a directory")
        if _has_marker(self.root):
            return "marked"
        if not self.root.exists() or not any(self.root.iterdir()):
            return "new"
        why = _not_proven(self.root)
        if why:
            raise ArtifactError(f"{self.root} is not a kvbuffer kernel cache ({why}; and it has no {MARKER} "
                                "written by kvbuffer): kvbuffer neither reads nor changes it. Pass --cache-dir or "
                                "set KVBUFFER_CACHE_DIR to kvbuffer's own cache or to a new or empty folder")
        return "proven"

    def check_ours(self) -> None:
        """ownership(), remembered once the folder is known to be kvbuffer's."""
        if not self._ours:
            self._ours = self.ownership() in ("marked", "proven")

    def mark(self) -> None:
        """Recognise the folder (ownership) and write kvbuffer's marker if it has none: writers call
        this before changing anything, so that a cache kvbuffer created stays recognised whatever
        becomes of its manifest."""
        self.check_ours()
        if _has_marker(self.root):
            return
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if marker.is_dir() and not marker.is_symlink():  # kvbuffer's name, damaged: replaced like any entry
            shutil.rmtree(marker, ignore_errors=True)
        tmp = self.root / f".{MARKER}.{os.getpid()}.{os.urandom(4).hex()}"
        try:
            tmp.write_text(MARKER_TEXT)
            os.replace(tmp, marker)
        finally:
            tmp.unlink(missing_ok=True)
        self._ours = True

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A consistent view for a whole listing: the cache's lock, shared (writers hold it exclusively
        while they change anything). A root without a lock file yet, or one this process may not
        open, is read without it."""
        self.check_ours()
        try:
            f = open(self.root / LOCK, "r")
        except OSError:
            yield
            return
        with f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    # -- manifest
    def manifest(self) -> dict:
        self.check_ours()
        path = self.root / MANIFEST
        if not path.exists():
            return empty_manifest()
        return read_checked_json(path, "cache manifest", manifest_problem, self.repair_hint)

    @property
    def repair_hint(self) -> str:
        return f"clear it with `kvbuffer cache clear --yes --cache-dir {self.root}` and rebuild"

    def inside(self, rel: str, where: str) -> Path:
        """root / rel, refused unless it resolves inside the cache root (symlinks and '..' included):
        a copied cache must never make kvbuffer read or delete anything else."""
        path = self.root / str(rel)
        try:
            inside = path.resolve().is_relative_to(self.root.resolve())
        except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the name
            inside = False
        if not isinstance(rel, str) or Path(rel).is_absolute() or not inside:
            raise ArtifactError(f"{where}: {rel!r} points outside the cache root {self.root}; the cache is "
                                f"corrupt: {self.repair_hint}")
        return path

    def artifact_dir(self, name: str) -> Path:
        return self.root / "artifacts" / check_entry_name(name, "artifact name")

    def tuning_path(self, name: str) -> Path:
        return self.root / "tunings" / f"{check_entry_name(name, 'tuning record name')}.json"

    # -- verification
    def _check_files(self, section: str, name: str, hint: str, manifest: dict | None = None) -> dict:
        """The manifest entry of `name`, after checking that each of its files is there and intact.
        `manifest`: the one a caller looping over entries already read (reading and checking it per
        entry made a listing quadratic in the entries)."""
        entry = (manifest or self.manifest())[section].get(name)
        if entry is None:
            raise ArtifactError(f"no {section[:-1]} {name!r} in {self.root / MANIFEST}; {hint}")
        for rel, digest in entry["files"].items():
            path = self.inside(rel, f"{section[:-1]} {name}")
            if not path.is_file():
                raise ArtifactError(f"{section[:-1]} {name}: {path} is missing; {hint}")
            try:
                actual = sha256_file(path)
            except OSError as e:
                raise ArtifactError(f"{section[:-1]} {name}: cannot read {path} ({e.strerror}); {hint}") from None
            if actual != digest:
                raise ArtifactError(f"{section[:-1]} {name}: checksum mismatch for {path} (manifest "
                                    f"{digest[:12]}, file {actual[:12]}): truncated or altered; {hint}")
        return entry

    def verify(self, name: str, manifest: dict | None = None) -> dict:
        """Checksums against the manifest (`manifest`: one the caller read, else the cache's), then the
        meta's key against the directory name; returns meta."""
        entry = self._check_files("artifacts", name, rebuild_hint(root=self.root), manifest)
        path = self.artifact_dir(name) / META
        try:
            meta = json.loads(path.read_text())
            key = ArtifactKey.from_json(meta["key"])
            meta["files"].get(LIBRARY), meta["function"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"artifact {name}: unreadable {path} ({type(e).__name__}: {e}); "
                                f"{rebuild_hint(root=self.root)}") from None
        hint = rebuild_hint(key.gpu, key.shape, self.root)
        if key.name != name:
            raise ArtifactError(f"artifact {name}: its meta.json describes {key.name}; {hint}")
        lib = f"artifacts/{name}/{LIBRARY}"
        if meta["files"].get(LIBRARY) != entry["files"].get(lib):
            raise ArtifactError(f"artifact {name}: meta.json and manifest disagree on {LIBRARY}; {hint}")
        return meta

    def status(self, name: str) -> str:
        entry = self.manifest()["artifacts"].get(name)
        if entry is None:
            raise ArtifactError(f"no artifact {name!r} in {self.root / MANIFEST}")
        return entry["status"]

    # -- compatibility
    def check_compatible(self, key: ArtifactKey, *, arch: str | None, gpu: str | None = None) -> None:
        """Reject artifacts built by other kvbuffer / TileLang versions, from other template sources or for
        another GPU arch."""
        hint = rebuild_hint(gpu or key.gpu, key.shape, self.root)
        have = runtime_versions()
        for lib in CHECKED_VERSIONS:
            built = key.versions.get(lib)
            if have[lib] is None and lib == "tilelang" and os.environ.get("KVBUFFER_TVM_RUNTIME"):
                log.warning("kvbuffer: tilelang wheel not installed; trusting KVBUFFER_TVM_RUNTIME to be "
                            "TileLang %s's runtime", built)
                continue
            if built != have[lib]:
                raise ArtifactError(f"artifact {key.name} was built with {lib} {built}, this process has "
                                    f"{lib} {have[lib]}; {hint}")
        if arch is not None and key.arch != arch:
            raise ArtifactError(f"artifact {key.name} is built for {key.arch} ({key.gpu}), this GPU is "
                                f"{arch}{f' ({gpu})' if gpu else ''}; {hint}")

    def _check_binary_arch(self, key: ArtifactKey, path: Path) -> None:
        sms = embedded_cubin_sms(path)
        if sms and sms != {arch_number(key.arch)}:
            raise ArtifactError(f"artifact {key.name}: meta says {key.arch} but the embedded cubin is "
                                f"sm_{'/'.join(map(str, sorted(sms)))}; "
                                f"{rebuild_hint(key.gpu, key.shape, self.root)}")

    # -- loading
    def load(self, name: str, *, arch: str | None = "local", gpu: str | None = None,
             expect: tuple | None = None) -> Artifact:
        """Verify and load one artifact. arch='local' checks against the local GPU (none: not checked).
        expect: (kernel, shape, chunk size, drafts) the caller looked it up for (check_artifact_matches)."""
        meta = self.verify(name)
        key = ArtifactKey.from_json(meta["key"])
        if expect is not None:
            check_artifact_matches(key, *expect)
        if arch == "local":
            arch, gpu = _local_arch()
        self.check_compatible(key, arch=arch, gpu=gpu)
        path = self.artifact_dir(name) / LIBRARY
        self._check_binary_arch(key, path)
        module, fn = load_library(path, meta["function"])
        return Artifact(name, meta, path, module, fn)


def read_checked_json(path: Path, what: str, problem_of: Callable[[object], str | None], hint: str):
    """JSON from a cache file, or one ArtifactError naming the file, what is wrong, and the fix."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ArtifactError(f"unreadable {what} {path}: {e}; {hint}") from None
    problem = problem_of(data)
    if problem:
        raise ArtifactError(f"{what} {path} {problem}; {hint}")
    return data


def empty_manifest() -> dict:
    return {"format": FORMAT, "artifacts": {}, "tunings": {}}


def manifest_problem(data: object) -> str | None:
    """What makes `data` not a manifest of this format (None: it is one). Every name and field the
    readers and `cache clear` use is checked here once, so they can index without guarding."""
    if not isinstance(data, dict):
        return f"is a JSON {type(data).__name__}, not an object"
    if data.get("format") != FORMAT:
        return f"has format {data.get('format')!r}, this kvbuffer reads format {FORMAT}"
    for section in ("artifacts", "tunings"):
        entries = data.get(section)
        if not isinstance(entries, dict):
            return f"has no {section!r} object"
        for name, entry in entries.items():
            try:
                check_entry_name(name, section)
            except ArtifactError:
                return f"names {section[:-1]} {name!r}, which is not a plain entry name"
            if not isinstance(entry, dict) or entry.get("status") not in STATUSES:
                return f"{section[:-1]} {name}: needs a 'status' in {STATUSES}"
            files = entry.get("files")
            if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in files.items()):
                return f"{section[:-1]} {name}: needs 'files' mapping paths to sha256 digests"
            if section == "tunings" and not (isinstance(entry.get("shape"), dict)
                                             and isinstance(entry.get("versions"), dict)):
                return f"tuning record {name}: needs 'shape' and 'versions' objects"
    return None


def _has_marker(root: Path) -> bool:
    try:
        return (root / MARKER).read_text().startswith(MARKER_TEXT)
    except (OSError, ValueError):  # ValueError: not UTF-8
        return False


def _not_proven(root: Path) -> str | None:
    """Why an unmarked, non-empty folder is not provably a kvbuffer cache (None: it is one). It must
    hold only names kvbuffer writes, and either a manifest exactly kvbuffer's (or none), or, its
    manifest damaged, an artifact whose meta.json names it, or kvbuffer's lock file next to entries
    named as kvbuffer names them (a readable name, '-', 16 hex digits of their key's sha256)."""
    strangers = _foreign_names(root)
    if strangers:
        return f"it holds {strangers[0]!r}, a name kvbuffer never writes"
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError, RecursionError):
        data = None
    why = own_manifest_problem(data) if data is not None else "is not a readable JSON file"
    if why is None or _self_named_artifact(root) or _hashed_entries_and_lock(root):
        return None
    return f"its {MANIFEST} {why}"


def _hashed_entries_and_lock(root: Path) -> bool:
    if not (root / LOCK).is_file():
        return False
    names = [p.name for sub in ("artifacts", "tunings") if (root / sub).is_dir() for p in (root / sub).iterdir()]
    return any(HASHED_NAME.fullmatch(n.removesuffix(".json")) for n in names)


def own_manifest_problem(data: object) -> str | None:
    """What makes `data` not a manifest kvbuffer wrote (None: it is exactly one): manifest_problem's
    checks, then nothing but kvbuffer's keys and each entry's files under its own name."""
    problem = manifest_problem(data)
    if problem is not None:
        return problem
    if set(data) != {"format", "artifacts", "tunings"}:
        return f"has keys {sorted(set(data) - {'format', 'artifacts', 'tunings'})} kvbuffer does not write"
    expect = {"artifacts": lambda n: {f"artifacts/{n}/{LIBRARY}", f"artifacts/{n}/{META}"},
              "tunings": lambda n: {f"tunings/{n}.json"}}
    for section, files in expect.items():
        for name, entry in data[section].items():
            if set(entry["files"]) != files(name):
                return f"lists {section[:-1]} {name!r}, which is not one kvbuffer names"
    return None


def _self_named_artifact(root: Path, limit: int = 64) -> bool:
    """An artifact directory whose meta.json holds the key its name was hashed from (proof enough)."""
    folder = root / "artifacts"
    if folder.is_symlink() or not folder.is_dir():
        return False
    for i, d in enumerate(sorted(folder.iterdir())):
        if i >= limit:
            break
        try:
            if ArtifactKey.from_json(json.loads((d / META).read_text())["key"]).name == d.name:
                return True
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            continue
    return False


def _foreign_names(root: Path) -> list[str]:
    """Names in the root (and in staging/, artifacts/, tunings/) kvbuffer would never write."""
    out = [p.name for p in root.iterdir()
           if p.name not in (MANIFEST, LOCK, MARKER, "artifacts", "tunings", "staging") and not TEMP_NAME.fullmatch(p.name)]
    for sub, own in (("staging", STAGING_NAME), ("artifacts", ENTRY_NAME), ("tunings", None)):
        folder = root / sub
        if folder.is_dir() and not folder.is_symlink():
            for p in folder.iterdir():
                ok = own.fullmatch(p.name) if own else p.name.endswith(".json") and ENTRY_NAME.fullmatch(p.name[:-5])
                if not ok:
                    out.append(f"{sub}/{p.name}")
    return out


def check_artifact_matches(key: ArtifactKey, kernel: str, shape: Mapping, chunk_size: int, drafts: int) -> None:
    """A tuning record names artifacts by name only: the artifact's own key (template, shape, chunk
    size, buffer layout) must be what the lookup asked for, or an edited record could run one
    kernel's arguments through another kernel."""
    want = {"kernel": kernel, "shape": dict(shape), "drafts": drafts}
    have = {"kernel": key.kernel, "shape": dict(key.shape), "drafts": key.drafts}
    if have != want or key.chunk_size not in (chunk_size, 0):
        raise ArtifactError(f"artifact {key.name} is a {key.kernel} kernel for {slug(key.shape)}, chunk size "
                            f"{key.chunk_size}, {key.drafts} drafts; the tuning record names it for {kernel} "
                            f"{slug(shape)}, chunk size {chunk_size}, {drafts} drafts: the record is corrupt; "
                            f"{rebuild_hint(key.gpu, shape)}")


def _local_arch() -> tuple[str | None, str | None]:
    from .gpus import detect_local_gpu

    gpu = detect_local_gpu()
    return (gpu.arch, gpu.name) if gpu else (None, None)
