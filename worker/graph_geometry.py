"""The shapes a decode graph runner is built for, and the state slots its padding rows take."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from phalanx.protocol.buckets import bucket_for


class GraphError(RuntimeError):
    """A graph phase arrived out of order, or a batch does not fit the captured shapes."""


@dataclass(frozen=True)
class GraphGeometry:
    """Shapes the runner is built for.

    ``max_batch`` is the effective decode batch: decode slots are ``0..max_batch-1`` and every
    bucket up to ``bucket_for(max_batch)`` is captured. Padding rows take free decode slots first,
    then the spare slots ``spare_slot_base..`` that complete the graph slot reserve to the top
    bucket (see ``worker.buckets.state_slot_layout``). ``max_pages`` is the page-table width of
    every row; ``padding_page`` is the reserved padding KV page; ``hidden_size`` and ``dtype``
    shape the warm-up all-reduce.
    """

    max_batch: int
    max_pages: int
    padding_page: int
    spare_slot_base: int
    hidden_size: int
    dtype: torch.dtype
    world_size: int = 1

    def padding_candidates(self) -> list[int]:
        """Every state slot a padding row may use, in order of preference."""
        spare = bucket_for(self.max_batch) - self.max_batch
        return list(range(self.max_batch)) + list(range(self.spare_slot_base, self.spare_slot_base + spare))


def padding_slots(
    real_slots: list[int], bucket: int, candidates: list[int], occupied: Collection[int]
) -> list[int]:
    """Free state slots for the ``bucket - len(real_slots)`` padding rows, from ``candidates``.

    A slot is free when no row of this batch and no live request (``occupied``) uses it. Dense
    batches (rows in decode slots ``0..n-1``, nothing live above) take ``candidates[n:bucket]``.
    """
    n = len(real_slots)
    needed = bucket - n
    if needed == 0:
        return []
    if real_slots == candidates[:n] and all(s < n for s in occupied) and bucket <= len(candidates):
        return candidates[n:bucket]
    taken = set(real_slots).union(occupied)
    free = [s for s in candidates if s not in taken][:needed]
    if len(free) < needed:
        raise GraphError(
            f"decode bucket {bucket} needs {needed} padding state slots but only {len(free)} of "
            f"{len(candidates)} are free"
        )
    return free
