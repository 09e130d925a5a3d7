"""Tuning records, read side: which chunk size C for batch B, and which artifact for a kernel.

`kvbuffer tune` (kvbuffer.autotune, the compile side) writes one JSON record per GPU, head shape and
kvbuffer/TileLang versions; the runtime only reads them, through this module. It also holds the
record's shape helpers (the head-shape and conv-shape dicts the records are keyed by), so the
runtime never imports the compile side. Imports neither TileLang nor torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping

from .artifacts import (CHECKED_VERSIONS, ArtifactStore, check_entry_name, read_checked_json, rebuild_hint,
                        runtime_versions, safe_name, sha256_json, slug)
from .errors import ArtifactError

TUNING_FORMAT = 1
SHAPE_DTYPES = ("bfloat16", "float16", "float32")


def make_shape(family: str, Hk: int, Hv: int, K: int, V: int, dtype: str = "bfloat16") -> dict:
    """A tuning record's head shape (kvbuffer.pools.LinearLayerShape's generic form; Mamba-2: Hk =
    groups G, Hv = heads H, K = state size N, V = head dim P) and the activations' dtype."""
    if family not in ("gdn", "mamba2"):
        raise ValueError(f"family must be 'gdn' or 'mamba2', got {family!r}")
    if min(Hk, Hv, K, V) < 1 or Hv % Hk:
        raise ValueError(f"need positive Hk, Hv, K, V with Hv a multiple of Hk, got {Hk},{Hv},{K},{V}")
    if dtype not in SHAPE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(SHAPE_DTYPES)}, got {dtype!r}")
    return {"family": family, "Hk": int(Hk), "Hv": int(Hv), "K": int(K), "V": int(V), "dtype": dtype}


def local_tuning(shape: Mapping) -> tuple[dict, str]:
    """(the tuning record of this machine's GPU for `shape`, the GPU's name); an ArtifactError says
    why there is none (no CUDA GPU here, or no record for this shape and these versions, naming the
    tune command)."""
    from .gpus import detect_local_gpu

    gpu = detect_local_gpu()
    if gpu is None:
        raise ArtifactError("no known GPU here")
    return TuningStore().find_tuning(gpu.name, gpu.arch, shape), gpu.name


def make_conv_shape(D: int, W: int, dtype: str, w_dtype: str, bias: bool) -> dict:
    """A tuning record's shape for the short conv's kernels (kvbuffer.kernels.conv)."""
    return {"family": "conv1d", "D": int(D), "W": int(W), "dtype": dtype, "w_dtype": w_dtype, "bias": bool(bias)}


@dataclass(frozen=True)
class ChunkPolicy:
    """Batch buckets (ascending upper bounds) -> chunk size; batches above the last use the last.

    unbuffered_rows: the decode batches up to which the recurrent step beat the buffered one (per
    token, flushes included) in every bucket from the smallest, which the engine then runs
    unbuffered (kvbuffer.engine.runner); 0 where the buffered step won at the smallest bucket,
    None where the record does not say (the engine's default applies).
    """

    buckets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    status: str = "untuned"
    unbuffered_rows: int | None = None

    def __post_init__(self):
        if not self.buckets or len(self.buckets) != len(self.chunk_sizes):
            raise ValueError(f"need one chunk size per bucket, got {self.buckets} / {self.chunk_sizes}")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive batch sizes, got {self.buckets}")
        if self.unbuffered_rows is not None and not (isinstance(self.unbuffered_rows, int)
                                                     and not isinstance(self.unbuffered_rows, bool)
                                                     and self.unbuffered_rows >= 0):
            raise ValueError(f"unbuffered_rows must be an int >= 0 or None, got {self.unbuffered_rows!r}")

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds `batch` (the largest one beyond it)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def chunk_for(self, batch: int) -> int:
        return self.chunk_sizes[self.buckets.index(self.bucket_for(batch))]

    @classmethod
    def from_timings(cls, timings: Mapping[tuple[int, int], float],
                     recurrent: Mapping[int, float] | None = None) -> "ChunkPolicy":
        """{(bucket, C): per-token seconds of the buffered step} -> the fastest C per bucket (ties: the
        smaller C); with `recurrent` ({bucket: seconds of the recurrent step}), unbuffered_rows too."""
        buckets = sorted({b for b, _ in timings})
        best = [min((t, c) for (b, c), t in timings.items() if b == bucket) for bucket in buckets]
        unbuffered = None
        if recurrent and buckets[0] == 1 and 1 in recurrent:  # else nothing is known of one row
            unbuffered = 0
            for bucket, (t, _) in zip(buckets, best):
                if bucket not in recurrent or recurrent[bucket] >= t:
                    break
                unbuffered = bucket
        return cls(tuple(buckets), tuple(c for _, c in best), "tuned", unbuffered)

    @classmethod
    def default(cls, buckets, chunk_sizes) -> "ChunkPolicy":
        cs = sorted(chunk_sizes)
        return cls(tuple(sorted(buckets)), (cs[(len(cs) - 1) // 2],) * len(buckets), "untuned")

    def to_json(self) -> dict:
        out = {"status": self.status, "buckets": {str(b): c for b, c in zip(self.buckets, self.chunk_sizes)}}
        return out if self.unbuffered_rows is None else out | {"unbuffered_rows": self.unbuffered_rows}

    @classmethod
    def from_json(cls, d: Mapping) -> "ChunkPolicy":
        items = sorted((int(b), int(c)) for b, c in d["buckets"].items())
        return cls(tuple(b for b, _ in items), tuple(c for _, c in items), d["status"], d.get("unbuffered_rows"))


def tuning_key(gpu: str, arch: str, shape: Mapping, versions: Mapping) -> dict:
    """What a tuning record is looked up by at run time (nvcc is not needed there, so not in it)."""
    return {"format": TUNING_FORMAT, "gpu": gpu, "arch": arch, "shape": dict(shape),
            "versions": {k: versions.get(k) for k in CHECKED_VERSIONS}}


def tuning_name(gpu: str, arch: str, shape: Mapping, versions: Mapping) -> str:
    key = tuning_key(gpu, arch, shape, versions)
    return safe_name(f"{gpu}_{arch}_{slug(shape)}") + "-" + sha256_json(key)[:16]


def record_problem(record: object) -> str | None:
    """What makes `record` not a tuning record `select` can read (None: it is one). Records come from
    a cache that may have been copied or edited; every winner must name an artifact by a plain name."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object"
    policy = record.get("chunk_policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("buckets"), dict):
        return "has no 'chunk_policy' with 'buckets'"
    try:
        ChunkPolicy.from_json(policy)
    except (KeyError, TypeError, ValueError) as e:
        return f"has an invalid chunk_policy ({e})"
    winners = record.get("winners")
    if not isinstance(winners, list):
        return "has no 'winners' list"
    fields = {"kernel": str, "batch_bucket": int, "chunk_size": int, "artifact": str}
    for i, w in enumerate(winners):
        if not isinstance(w, dict) or not all(isinstance(w.get(f), t) for f, t in fields.items()) \
                or not isinstance(w.get("drafts", 0), int):
            return f"winner {i}: needs {', '.join(fields)} (and an int 'drafts')"
        try:
            check_entry_name(w["artifact"], f"winner {i}")
        except ArtifactError as e:
            return str(e).split(";")[0]
    return None


def select(record: Mapping, kernel: str, batch: int, chunk_size: int | None = None,
           drafts: int = 0) -> tuple[str, int]:
    """(artifact name, chunk size) for `kernel` at `batch` from a tuning record (JSON as stored).

    chunk_size None takes the policy's choice for the batch; kernels without a chunk size
    (the recurrent step) are stored with chunk_size 0 and match any. drafts picks the buffer layout
    (0: plain decoding); kernels that do not depend on it (the recurrent step) are stored and
    looked up with drafts 0.
    """
    policy = ChunkPolicy.from_json(record["chunk_policy"])
    bucket = policy.bucket_for(batch)
    c = policy.chunk_for(batch) if chunk_size is None else chunk_size
    for w in record["winners"]:
        if w["kernel"] == kernel and w["batch_bucket"] == bucket and w["chunk_size"] in (c, 0) \
                and w.get("drafts", 0) == drafts:
            return w["artifact"], c
    layout = f", {drafts} speculative drafts" if drafts else ""
    built = sorted(set(record.get("draft_tokens", [0])) - {0})
    hint = f" (drafts built: {built or 'none'}; add --draft-tokens {drafts})" if drafts and drafts not in built else ""
    raise KeyError(f"no {kernel} kernel for batch bucket {bucket}, chunk size {c}{layout} in this tuning record{hint}")


class TuningStore(ArtifactStore):
    """An artifact store that also reads the tuning records in it."""

    def tuning(self, name: str, manifest: dict | None = None) -> dict:
        """A tuning record, after its checksum (against `manifest`, as in verify) and its structure
        (record_problem)."""
        hint = rebuild_hint(root=self.root)
        self._check_files("tunings", name, hint, manifest)
        return read_checked_json(self.tuning_path(name), "tuning record", record_problem, hint)

    def find_tuning(self, gpu: str, arch: str, shape: Mapping) -> dict:
        """The tuning record for this GPU and head shape under this process's versions."""
        name = tuning_name(gpu, arch, shape, runtime_versions())
        tunings = self.manifest()["tunings"]
        if name in tunings:
            return self.tuning(name)
        hint = rebuild_hint(gpu, shape, self.root)
        others = [n for n, e in tunings.items()
                  if e.get("gpu") == gpu and e.get("shape") == dict(shape)]
        if others:
            found = {lib: tunings[others[0]]["versions"].get(lib) for lib in CHECKED_VERSIONS}
            raise ArtifactError(f"kernels for {gpu} {slug(shape)} exist for {found}, not for this "
                                f"process's {runtime_versions()}; {hint}")
        raise ArtifactError(f"no kernels built for {gpu} ({arch}) {slug(shape)} in {self.root}; {hint}")
