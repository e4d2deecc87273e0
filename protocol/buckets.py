"""Decode batch buckets: the batch sizes a CUDA graph is captured for.

Part of the contract because both sides use the numbers: the coordinator sends
``Precapture(Capture(bucket))`` for every bucket up to ``bucket_for(max_slots)``, and a rank pads
each decode batch up to ``bucket_for(rows)`` and replays that bucket's graph. No torch here.
"""

from __future__ import annotations

DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_BATCH = DECODE_BUCKETS[-1]


def bucket_for(n: int) -> int:
    """The smallest decode bucket that holds ``n`` rows."""
    if n < 1:
        raise ValueError(f"decode batch of {n} rows has no bucket; a batch has at least one row")
    for bucket in DECODE_BUCKETS:
        if bucket >= n:
            return bucket
    raise ValueError(f"decode batch of {n} rows exceeds the largest graph bucket {MAX_GRAPH_BATCH}")


def buckets_up_to(max_batch: int) -> tuple[int, ...]:
    """Every bucket a batch of at most ``max_batch`` rows can land in (the pre-capture sweep's)."""
    top = bucket_for(max_batch)
    return tuple(b for b in DECODE_BUCKETS if b <= top)
