"""A step command's chunks and rows once checked: against this rank's state (``worker/commands.py``)
and, here, each request's own values (``judge_chunk``, ``judge_row``).

A value inside the wire limits can still be one this rank cannot compute with: a token id outside
the model's vocabulary (a prompt chunk's tokens or ``next_token``, a decode row's token, a
``logit_bias`` or banned id). Such a value fails its request alone (``RequestRejected``,
``protocol.replies``): the chunk or row still runs, with token 0 in place of each bad id and the
bad sampling ids left out, so every rank runs the same batch; the rank returns the values it runs
with and the reason, which rank 0 answers instead of the request's token. Every rank judges these
alike: the vocabulary is the model's, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_TOKEN,
    DecodeRow,
    PrefillChunk,
    RequestRejected,
    SamplingParams,
)
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


def _outside(token: int, vocab_size: int) -> str:
    return f"token id {token} is outside the vocabulary [0, {vocab_size})"


def _judge_sampling(params: SamplingParams, vocab_size: int) -> tuple[SamplingParams, str | None]:
    """``params`` without the ids outside the vocabulary, and the first such id's reason."""
    bias = params.logit_bias or {}
    banned = params.banned_ids or []
    bad_bias = [token for token in bias if not 0 <= token < vocab_size]
    bad_banned = [token for token in banned if not 0 <= token < vocab_size]
    if not bad_bias and not bad_banned:
        return params, None
    field, token = ("logit_bias", bad_bias[0]) if bad_bias else ("a banned", bad_banned[0])
    kept = msgspec.structs.replace(
        params,
        logit_bias={t: b for t, b in bias.items() if 0 <= t < vocab_size} or None,
        banned_ids=[t for t in banned if 0 <= t < vocab_size] or None,
    )
    return kept, f"{field} {_outside(token, vocab_size)}"


def judge_chunk(
    chunk: PrefillChunk, tokens: list[int], vocab_size: int
) -> tuple[PrefillChunk, list[int], str | None]:
    """The chunk and its tokens as this rank runs them, and why its request is rejected (None:
    it is not)."""
    reason = None
    if min(tokens) < 0 or max(tokens) >= vocab_size:
        at, token = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size)
        reason = f"prompt {_outside(token, vocab_size)} (position {chunk.start + at})"
        tokens = [t if 0 <= t < vocab_size else 0 for t in tokens]
    if chunk.next_token != NO_TOKEN and not 0 <= chunk.next_token < vocab_size:
        position = chunk.start + len(tokens)
        reason = reason or f"prompt {_outside(chunk.next_token, vocab_size)} (position {position})"
        chunk = msgspec.structs.replace(chunk, next_token=0)
    sampling, sampling_reason = _judge_sampling(chunk.sampling, vocab_size)
    if sampling_reason is not None:
        chunk = msgspec.structs.replace(chunk, sampling=sampling)
    return chunk, tokens, reason or sampling_reason


def judge_row(row: DecodeRow, vocab_size: int) -> tuple[DecodeRow, str | None]:
    """The row as this rank runs it, and why its request is rejected (None: it is not)."""
    reason = None
    if row.token != FED_TOKEN and not 0 <= row.token < vocab_size:
        reason = f"decode {_outside(row.token, vocab_size)} (position {row.position})"
        row = msgspec.structs.replace(row, token=0)
    sampling, sampling_reason = _judge_sampling(row.sampling, vocab_size)
    if sampling_reason is not None:
        row = msgspec.structs.replace(row, sampling=sampling)
    return row, reason or sampling_reason
