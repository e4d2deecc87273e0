"""A step command's chunks and rows once checked against this rank's state (``worker/commands.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.protocol.messages import DecodeRow, PrefillChunk
from phalanx.worker.request_table import RequestState


@dataclass
class ChunkPlan:
    """A prefill chunk, checked: its request's state, its tokens and its pages."""

    chunk: PrefillChunk
    state: RequestState
    tokens: list[int]
    pages: list[int]


@dataclass
class RowPlan:
    """A decode row, checked: its request's state and its pages."""

    row: DecodeRow
    state: RequestState
    pages: list[int]
