"""A step command's chunks and rows once checked against this rank's state (``worker/commands.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phalanx.protocol.messages import DecodeRow, PrefillChunk, RequestRejected
from phalanx.worker.request_table import RequestState


@dataclass
class ChunkPlan:
    """A prefill chunk, checked: its request's state, its tokens and its pages. A rejected chunk
    (``rejected``: why) carries the values it runs with in place of the bad ones."""

    chunk: PrefillChunk
    state: RequestState
    tokens: list[int]
    pages: list[int]
    rejected: str | None = None

    @property
    def request_id(self) -> int:
        return self.chunk.request_id


@dataclass
class RowPlan:
    """A decode row, checked: its request's state and its pages; ``rejected`` as for a chunk."""

    row: DecodeRow
    state: RequestState
    pages: list[int]
    rejected: str | None = None

    @property
    def request_id(self) -> int:
        return self.row.request_id


def rejections(plans: Sequence[ChunkPlan | RowPlan]) -> list[RequestRejected]:
    """The rejected requests among ``plans``, in plan order."""
    return [RequestRejected(plan.request_id, plan.rejected) for plan in plans if plan.rejected is not None]
