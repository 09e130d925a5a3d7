"""Tuning records for tests that fill a cache without tuning."""

from kvbuffer.tuning import ChunkPolicy


def empty_record() -> dict:
    """The smallest tuning record put_tuning merges: a policy, its buckets, no winners."""
    return {"status": "untuned", "chunk_policy": ChunkPolicy.default([1], [16]).to_json(), "batch_buckets": [1],
            "chunk_sizes": [16], "winners": []}
