"""What the scheduler and the executor owe each other: the calls the scheduler makes on the
executor (``StepExecutor``; ``PipelinedExecutor`` to keep a step in flight), and the check that a
step's answer holds exactly one result per row it was sent (``align_results``), which raises
``ArtifactError``, since a replica whose rank 0 answers other rows can no longer be trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from phalanx.protocol.messages import (
    NO_TOKEN,
    Capacity,
    DecodeDone,
    DecodeRow,
    Expectation,
    PrefillChunk,
    PrefillDone,
    PromptLogprobs,
    SlotMove,
    TokenResult,
    UnifiedDone,
)
from phalanx.scheduler.events import PromptLogprobsEvent, TokenEvent


class StepExecutor(Protocol):
    """The part of the executor the scheduler drives (``executor.runtime.Executor`` is it)."""

    @property
    def capacity(self) -> Capacity: ...

    def prefill(self, chunks: list[PrefillChunk]) -> PrefillDone: ...

    def decode(self, rows: list[DecodeRow]) -> DecodeDone: ...

    def unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> UnifiedDone: ...

    def drop(self, request_id: int, expectation: Expectation, move: SlotMove | None = None) -> None: ...


class PipelinedExecutor(StepExecutor, Protocol):
    """An executor that can have a step in flight while it sends the next (``pipeline=True``)."""

    def send_decode(self, rows: list[DecodeRow]) -> Any: ...

    def collect_decode(self, step: Any) -> DecodeDone: ...

    def send_prefill(self, chunks: list[PrefillChunk]) -> Any: ...

    def collect_prefill(self, step: Any) -> PrefillDone: ...

    def send_unified(self, chunks: list[PrefillChunk], rows: list[DecodeRow]) -> Any: ...

    def collect_unified(self, step: Any) -> UnifiedDone: ...


PIPELINE_CALLS = (
    "send_decode",
    "collect_decode",
    "send_prefill",
    "collect_prefill",
    "send_unified",
    "collect_unified",
)


class ArtifactError(RuntimeError):
    """Rank 0's results do not match the rows of the step: the replica can no longer be trusted."""


def align_results(op: str, results: Sequence[TokenResult], expected: Sequence[int]) -> dict[int, TokenResult]:
    """Exactly one result per expected request id, in any order."""
    wanted = set(expected)
    aligned: dict[int, TokenResult] = {}
    for result in results:
        if result.request_id not in wanted:
            raise ArtifactError(
                f"invalid {op} artifact set: returned unknown or non-final request id {result.request_id}"
            )
        if result.request_id in aligned:
            raise ArtifactError(
                f"invalid {op} artifact set: returned duplicate request id {result.request_id}"
            )
        aligned[result.request_id] = result
    for request_id in expected:
        if request_id not in aligned:
            raise ArtifactError(f"invalid {op} artifact set: is missing final request id {request_id}")
    return aligned


def token_event(result: TokenResult) -> TokenEvent:
    top = None
    if result.top_ids is not None and result.top_logprobs is not None:
        top = list(zip(result.top_ids, result.top_logprobs, strict=True))
    return TokenEvent(token_id=result.token, logprob=result.logprob, top_logprobs=top)


def prompt_logprob_events(
    op: str, chunks: Sequence[PrefillChunk], scored: Sequence[PromptLogprobs]
) -> list[tuple[int, PromptLogprobsEvent]]:
    """Each chunk that asked for prompt logprobs gets exactly its own, in chunk order: the
    positions after its first up to the token that follows it."""
    asked = [chunk for chunk in chunks if chunk.prompt_logprobs is not None]
    if len(scored) != len(asked):
        raise ArtifactError(
            f"invalid {op} artifact set: {len(scored)} prompt logprob spans for {len(asked)} chunks that asked"
        )
    events = []
    for chunk, span in zip(asked, scored, strict=True):
        count = len(chunk.tokens) // 4 - (1 if chunk.next_token == NO_TOKEN else 0)
        if (span.request_id, span.start, len(span.logprobs), len(span.ranks)) != (
            chunk.request_id,
            chunk.start + 1,
            count,
            count,
        ):
            raise ArtifactError(
                f"invalid {op} artifact set: prompt logprobs of request {span.request_id} from {span.start} "
                f"({len(span.logprobs)}) answer chunk of request {chunk.request_id} from {chunk.start + 1} ({count})"
            )
        top = None
        if span.top_ids is not None and span.top_logprobs is not None:
            top = [list(zip(i, v, strict=True)) for i, v in zip(span.top_ids, span.top_logprobs, strict=True)]
        events.append((span.request_id, PromptLogprobsEvent(span.start, span.logprobs, span.ranks, top)))
    return events
