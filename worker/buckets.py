"""The graph slot reserve and the state slot layout, sized by the decode buckets.

The buckets themselves (``DECODE_BUCKETS``, ``bucket_for``) are the protocol's
(``protocol/buckets.py``): the coordinator and the ranks both use them.

In graph mode a rank keeps one fixed-address recurrent/conv state per graph row: a bucket-``b``
graph reads and writes the state slots named by its rows, and its padding rows need free slots
too, so the decode slot region must hold ``bucket_for(max_batch)`` states. That region (the graph
slot reserve) is taken out of free memory before the rest of capacity is sized, and it is sized
by the *effective* bucket: reserving for the requested batch could starve a tight-memory rank to
zero (``size_graph_slot_reserve``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phalanx.protocol.buckets import DECODE_BUCKETS, MAX_GRAPH_BATCH, bucket_for


def smaller_bucket(bucket: int) -> int | None:
    """The next bucket below ``bucket``, or None below the smallest."""
    index = DECODE_BUCKETS.index(bucket)
    return DECODE_BUCKETS[index - 1] if index > 0 else None


@dataclass(frozen=True)
class SlotReserve:
    """The outcome of sizing: how many requests decode together, and the slots held for graphs.

    ``max_batch`` is the effective decode batch (0 when not even one request fits);
    ``graph_slots`` = ``bucket_for(max_batch)`` states are reserved, ``reserve_bytes`` of memory.
    """

    max_batch: int
    graph_slots: int
    reserve_bytes: int


def size_graph_slot_reserve(
    requested: int, free_bytes: int, slot_bytes: int, capacity_for: Callable[[int], int]
) -> SlotReserve:
    """Fit the decode batch and its graph slot reserve into ``free_bytes``.

    ``capacity_for(budget_bytes)`` is the caller's ordinary capacity math: how many requests (at
    most ``requested``) fit in what is left once the reserve is taken. Start from
    ``bucket_for(requested)``; reserve that many slots; fit capacity into the rest; if the fitted
    batch lands in a smaller bucket, shrink the reserve to that bucket and fit again. The bucket
    only shrinks, so this ends, and the final ``bucket_for(max_batch)`` never exceeds the reserve.
    """
    if requested < 1:
        raise ValueError(f"requested decode batch {requested} must be at least 1")
    if slot_bytes < 0:
        raise ValueError(f"state bytes per slot {slot_bytes} must not be negative")
    slot_bucket: int | None = bucket_for(min(requested, MAX_GRAPH_BATCH))
    while slot_bucket is not None:
        reserve = slot_bucket * slot_bytes
        fitted = min(capacity_for(free_bytes - reserve), slot_bucket) if reserve <= free_bytes else 0
        if fitted >= 1 and bucket_for(fitted) >= slot_bucket:
            return SlotReserve(max_batch=fitted, graph_slots=slot_bucket, reserve_bytes=reserve)
        # Nothing fits beside this reserve: try the next smaller bucket; otherwise the fitted
        # batch's own bucket, which is smaller than this one.
        slot_bucket = bucket_for(fitted) if fitted >= 1 else smaller_bucket(slot_bucket)
    return SlotReserve(max_batch=0, graph_slots=0, reserve_bytes=0)


@dataclass(frozen=True)
class StateSlotLayout:
    """Which state slots of the model's pool hold what.

    ``0..max_slots-1`` are the dense decode slots, ``max_slots..2*max_slots-1`` the prefill
    staging states, and in graph mode ``spare_base..prefill_padding-1`` are spare slots that
    complete the decode region to the top bucket, so a padded batch always finds free slots for
    its padding rows (a batch of ``n`` rows pads to ``bucket_for(n) <= bucket_for(max_slots)``),
    and ``prefill_padding`` takes the padding chunk of a graphed prefill
    (``worker/prefill_graphs.py``). The prefix cache's snapshot slots come last,
    ``snapshot_base..total-1``: no step reads or writes them, only the copies of a restore or a
    save (``worker/snapshots.py``).
    """

    max_slots: int
    spare_base: int
    snapshot_base: int
    total: int
    prefill_padding: int | None = None  # graph mode only

    @property
    def snapshot_slots(self) -> int:
        return self.total - self.snapshot_base


def state_slot_layout(max_slots: int, cuda_graph: bool, snapshot_slots: int = 0) -> StateSlotLayout:
    spare = bucket_for(max_slots) - max_slots if cuda_graph else 0
    padding = 2 * max_slots + spare
    snapshot_base = padding + (1 if cuda_graph else 0)
    return StateSlotLayout(
        max_slots=max_slots,
        spare_base=2 * max_slots,
        snapshot_base=snapshot_base,
        total=snapshot_base + snapshot_slots,
        prefill_padding=padding if cuda_graph else None,
    )
