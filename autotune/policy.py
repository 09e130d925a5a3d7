"""Tuning records, write side: the winners a `kvbuffer tune` run publishes and how runs merge.

The read side (ChunkPolicy, tuning names, `select`) is kvbuffer.tuning, which the runtime imports.
A tuning record (one JSON file per GPU, head shape and kvbuffer/TileLang versions) lists, for each
(kernel, batch bucket, chunk size, buffer layout's drafts), the artifact that won (or the default
one, when untuned) and a chunk-size policy per batch bucket. Each `kvbuffer tune` run merges its
winners into the record (merge_records), so layouts and chunk sizes can be added run by run.

How C is chosen: the buffered step is timed in steady state, every row at a random buffer length
in [0, C), so on average 1/C of the rows fold their buffer into the state in that launch (the
fused flush). Its median time is then the cost per decoded token of chunk size C, flushes
included, and the policy keeps the fastest C for each bucket. The recurrent step's time per token
in the same buckets decides up to which batch the engine skips the buffer (the policy's
unbuffered_rows: the buckets, from the smallest, where the recurrent step was faster). Without
measurements (a build for an absent GPU) the policy is the middle of the requested chunk sizes,
marked untuned.

This module imports neither TileLang nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

POLICY_KERNELS = ("gdn_buffered_step", "mamba2_buffered_step")  # steady-state time per token decides C
RECURRENT_KERNELS = ("gdn_recurrent", "mamba2_recurrent")  # faster than those at small batch: unbuffered steps


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
