"""Chunk-size policy and tuning records: the runtime asks "which C for batch B, which kernel for it?".

A tuning record (one JSON file per GPU, head shape and kvbuffer/TileLang versions) lists, for each
(kernel, batch bucket, chunk size, buffer layout's drafts), the artifact that won (or the default
one, when untuned) and a chunk-size policy per batch bucket. Each `kvbuffer tune` run merges its
winners into the record (merge_records), so layouts and chunk sizes can be added run by run.

How C is chosen: the buffered step is timed in steady state, every row at a random buffer length
in [0, C), so on average 1/C of the rows fold their buffer into the state in that launch (the
fused flush). Its median time is then the cost per decoded token of chunk size C, flushes
included, and the policy keeps the fastest C for each bucket. Without measurements (a build for
an absent GPU) the policy is the middle of the requested chunk sizes, marked untuned.

This module imports neither TileLang nor torch: the runtime reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping

from kvbuffer.artifacts import safe_name, slug, sha256_json

TUNING_FORMAT = 1
POLICY_KERNELS = ("gdn_buffered_step", "mamba2_buffered_step")  # steady-state time per token decides C


@dataclass(frozen=True)
class ChunkPolicy:
    """Batch buckets (ascending upper bounds) -> chunk size; batches above the last use the last."""

    buckets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    status: str = "untuned"

    def __post_init__(self):
        if not self.buckets or len(self.buckets) != len(self.chunk_sizes):
            raise ValueError(f"need one chunk size per bucket, got {self.buckets} / {self.chunk_sizes}")
        if list(self.buckets) != sorted(set(self.buckets)) or self.buckets[0] < 1:
            raise ValueError(f"buckets must be ascending positive batch sizes, got {self.buckets}")

    def bucket_for(self, batch: int) -> int:
        """The smallest bucket that holds `batch` (the largest one beyond it)."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[min(i, len(self.buckets) - 1)]

    def chunk_for(self, batch: int) -> int:
        return self.chunk_sizes[self.buckets.index(self.bucket_for(batch))]

    @classmethod
    def from_timings(cls, timings: Mapping[tuple[int, int], float]) -> "ChunkPolicy":
        """{(bucket, C): per-token seconds} -> the fastest C per bucket (ties: the smaller C)."""
        buckets = sorted({b for b, _ in timings})
        best = [min((t, c) for (b, c), t in timings.items() if b == bucket)[1] for bucket in buckets]
        return cls(tuple(buckets), tuple(best), "tuned")

    @classmethod
    def default(cls, buckets, chunk_sizes) -> "ChunkPolicy":
        cs = sorted(chunk_sizes)
        return cls(tuple(sorted(buckets)), (cs[(len(cs) - 1) // 2],) * len(buckets), "untuned")

    def to_json(self) -> dict:
        return {"status": self.status, "buckets": {str(b): c for b, c in zip(self.buckets, self.chunk_sizes)}}

    @classmethod
    def from_json(cls, d: Mapping) -> "ChunkPolicy":
        items = sorted((int(b), int(c)) for b, c in d["buckets"].items())
        return cls(tuple(b for b, _ in items), tuple(c for _, c in items), d["status"])


def tuning_key(gpu: str, arch: str, shape: Mapping, versions: Mapping) -> dict:
    """What a tuning record is looked up by at run time (nvcc is not needed there, so not in it)."""
    return {"format": TUNING_FORMAT, "gpu": gpu, "arch": arch, "shape": dict(shape),
            "versions": {k: versions.get(k) for k in ("kvbuffer", "tilelang")}}


def tuning_name(gpu: str, arch: str, shape: Mapping, versions: Mapping) -> str:
    key = tuning_key(gpu, arch, shape, versions)
    return safe_name(f"{gpu}_{arch}_{slug(shape)}") + "-" + sha256_json(key)[:16]


@dataclass(frozen=True)
class Winner:
    """The artifact to run for one (kernel, batch bucket, chunk size, buffer layout); median_us is None
    when untuned. drafts: the speculative drafts T the buffers make room for (C + T + 1 entries)."""

    kernel: str
    batch_bucket: int
    chunk_size: int
    artifact: str
    tunables: Mapping
    median_us: float | None = None
    drafts: int = 0

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "batch_bucket": self.batch_bucket, "chunk_size": self.chunk_size,
                "drafts": self.drafts, "artifact": self.artifact, "tunables": dict(self.tunables),
                "median_us": self.median_us}


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


def _winner_key(w: Mapping) -> tuple:
    return w["kernel"], w["batch_bucket"], w["chunk_size"], w.get("drafts", 0)


def merge_records(old: Mapping | None, new: Mapping) -> tuple[dict, list[str]]:
    """The record to store after a tune run: `new`'s winners merged into `old`'s, and notes on what
    was kept or dropped.

    A winner of `new` replaces `old`'s for the same (kernel, bucket, chunk size, drafts), unless
    only the old one was measured (an untuned build never overrides a measurement). The chunk
    policy is `new`'s when it was measured or `old` has none measured. Records with other batch
    buckets cannot be merged (every winner must cover the policy's buckets): `new` replaces them.
    The status is "tuned" only when every winner was measured, and so was the policy if the record
    has a kernel that decides it (a conv record has none: its kernels serve every C).
    """
    if old is None:
        merged, notes = dict(new), []
    elif list(old["batch_buckets"]) != list(new["batch_buckets"]):
        merged = dict(new)
        notes = [f"replaced a record with batch buckets {old['batch_buckets']} ({len(old['winners'])} winners, "
                 f"chunk sizes {old['chunk_sizes']}, drafts {old.get('draft_tokens', [0])})"]
    else:
        winners = {_winner_key(w): w for w in old["winners"]}
        kept = 0
        for w in new["winners"]:
            before = winners.get(_winner_key(w))
            if before is not None and before["median_us"] is not None and w["median_us"] is None:
                kept += 1
                continue
            winners[_winner_key(w)] = w
        tuned_policy = new["chunk_policy"]["status"] == "tuned" or old["chunk_policy"]["status"] != "tuned"
        merged = dict(new, winners=sorted(winners.values(), key=_winner_key),
                      chunk_policy=new["chunk_policy"] if tuned_policy else old["chunk_policy"],
                      chunk_sizes=sorted(set(old["chunk_sizes"]) | set(new["chunk_sizes"])),
                      draft_tokens=sorted(set(old.get("draft_tokens", [0])) | set(new.get("draft_tokens", [0]))))
        notes = [f"kept {kept} measured winner(s) this untuned build also produced"] if kept else []
    measured = all(w["median_us"] is not None for w in merged["winners"])
    decides_c = any(w["kernel"] in POLICY_KERNELS for w in merged["winners"])
    policy_ok = merged["chunk_policy"]["status"] == "tuned" or not decides_c
    merged["status"] = "tuned" if measured and policy_ok else "untuned"
    return merged, notes
