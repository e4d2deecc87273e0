"""Validation of one step's replies, in one place: ``validate`` picks the check by command type.

A step's replies are collected first (``StepCollection``, at the end: exactly ``world_size`` of
them carrying the step's seq; a reply with another seq is a stale answer to an earlier step and is
rejected, never counted; the first ``Failed`` ends the collection at once, since a failed rank can
leave its peers blocked in a collective), then checked against the command that was sent: every
rank exactly once; rank 0 carries the step's reply and every other rank an Ack, or for a drop
every rank a DropAck that agrees with the expectation; a token reply names each request it
rejects once (``RequestRejected``: only that request fails, see ``protocol.replies``) and holds
exactly one token per other decode row and last prompt chunk, and one prompt-logprob span per
other chunk that asked. Anything else means the replica can no longer be trusted. The error texts
are part of the contract (the tests check them word for word).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog

from phalanx.executor.errors import ReplyError
from phalanx.protocol.messages import (
    COMMAND_NAMES,
    NO_TOKEN,
    REPLY_NAMES,
    Ack,
    Command,
    Decode,
    DecodeDone,
    DecodeRow,
    DropAck,
    DropRequest,
    Expectation,
    Failed,
    Heartbeat,
    Ping,
    Precapture,
    Prefill,
    PrefillChunk,
    PrefillDone,
    PromptLogprobs,
    Refused,
    ReplyEnvelope,
    RequestRejected,
    Shutdown,
    TokenResult,
    Unified,
    UnifiedDone,
)

T = TypeVar("T")
log = structlog.get_logger("phalanx.executor")

# What a validated step answers: rank 0's reply.
StepReply = Ack | DropAck | PrefillDone | DecodeDone | UnifiedDone

# How each expectation is spelled in error texts.
EXPECTATION_NAMES: dict[Expectation, str] = {
    Expectation.MUST_EXIST: "MustExist",
    Expectation.MUST_BE_ABSENT: "MustBeAbsent",
}


def reply_name(body: object) -> str:
    return REPLY_NAMES.get(type(body), type(body).__name__)


def command_name(command: object) -> str:
    return COMMAND_NAMES.get(type(command), type(command).__name__)


def validate_rank_set(op: str, replies: list[ReplyEnvelope], world_size: int) -> list[ReplyEnvelope]:
    """Every rank exactly once; returns the replies sorted by rank."""
    if len(replies) != world_size:
        raise ReplyError(f"{op} expected {world_size} replies, got {len(replies)}")
    seen: set[int] = set()
    for reply in replies:
        if not 0 <= reply.rank < world_size:
            raise ReplyError(f"{op} returned out-of-range rank {reply.rank} for world size {world_size}")
        if reply.rank in seen:
            raise ReplyError(f"{op} returned duplicate rank {reply.rank}")
        seen.add(reply.rank)
    return sorted(replies, key=lambda reply: reply.rank)


def validate_acks(op: str, replies: list[ReplyEnvelope], world_size: int) -> Ack:
    """Ping, Precapture, Shutdown: every rank answers Ack."""
    for reply in validate_rank_set(op, replies, world_size):
        if not isinstance(reply.body, Ack):
            raise ReplyError(
                f"{op} rank {reply.rank} returned {reply_name(reply.body)} instead of acknowledgement"
            )
    return Ack()


def validate_primary(op: str, replies: list[ReplyEnvelope], world_size: int, primary: type[T]) -> T:
    """Prefill, Decode, Unified: rank 0 returns the typed reply, every other rank Ack."""
    ordered = validate_rank_set(op, replies, world_size)
    first = ordered[0].body
    if not isinstance(first, primary):
        raise ReplyError(f"{op} rank 0 returned {reply_name(first)} instead of primary {op} reply")
    for reply in ordered[1:]:
        if not isinstance(reply.body, Ack):
            raise ReplyError(
                f"{op} non-primary rank {reply.rank} returned {reply_name(reply.body)} "
                "instead of acknowledgement"
            )
    return first


def validate_tokens(op: str, results: Sequence[TokenResult], expected: Sequence[int]) -> None:
    """Exactly one token per expected request id, in any order."""
    wanted = set(expected)
    seen: set[int] = set()
    for result in results:
        if result.request_id not in wanted:
            raise ReplyError(
                f"invalid {op} reply: returned unknown or non-final request id {result.request_id}"
            )
        if result.request_id in seen:
            raise ReplyError(f"invalid {op} reply: returned duplicate request id {result.request_id}")
        seen.add(result.request_id)
    for request_id in expected:
        if request_id not in seen:
            raise ReplyError(f"invalid {op} reply: is missing final request id {request_id}")


def validate_rejected(op: str, rejected: Sequence[RequestRejected], request_ids: Sequence[int]) -> set[int]:
    """Each rejected request is one of the command's, named once; returns their ids."""
    ids = [entry.request_id for entry in rejected]
    unknown = next((request_id for request_id in ids if request_id not in request_ids), None)
    if unknown is not None:
        raise ReplyError(f"invalid {op} reply: rejected request id {unknown} is not in the command")
    twice = next((request_id for index, request_id in enumerate(ids) if request_id in ids[:index]), None)
    if twice is not None:
        raise ReplyError(f"invalid {op} reply: rejected request id {twice} twice")
    return set(ids)


def validate_prompt_logprobs(
    op: str, chunks: Sequence[PrefillChunk], scored: Sequence[PromptLogprobs]
) -> None:
    """Each chunk that asked for prompt logprobs gets exactly its own, in chunk order: the
    positions after its first up to the token that follows it."""
    asked = [chunk for chunk in chunks if chunk.prompt_logprobs is not None]
    if len(scored) != len(asked):
        raise ReplyError(
            f"invalid {op} reply: {len(scored)} prompt logprob spans for {len(asked)} chunks that asked"
        )
    for chunk, span in zip(asked, scored, strict=True):
        count = len(chunk.tokens) // 4 - (1 if chunk.next_token == NO_TOKEN else 0)
        if (span.request_id, span.start, len(span.logprobs), len(span.ranks)) != (
            chunk.request_id,
            chunk.start + 1,
            count,
            count,
        ):
            raise ReplyError(
                f"invalid {op} reply: prompt logprobs of request {span.request_id} from {span.start} "
                f"({len(span.logprobs)}) answer chunk of request {chunk.request_id} from {chunk.start + 1} ({count})"
            )


def _finals(chunks: Sequence[PrefillChunk], rejected: set[int]) -> list[int]:
    return [chunk.request_id for chunk in chunks if chunk.last and chunk.request_id not in rejected]


def _rows(rows: Sequence[DecodeRow], rejected: set[int]) -> list[int]:
    return [row.request_id for row in rows if row.request_id not in rejected]


def _scored(chunks: Sequence[PrefillChunk], rejected: set[int]) -> list[PrefillChunk]:
    return [chunk for chunk in chunks if chunk.request_id not in rejected]


def validate_prefill(command: Prefill, replies: list[ReplyEnvelope], world_size: int) -> PrefillDone:
    done = validate_primary("prefill", replies, world_size, PrefillDone)
    rejected = validate_rejected("prefill", done.rejected, [chunk.request_id for chunk in command.chunks])
    validate_tokens("prefill", done.results, _finals(command.chunks, rejected))
    validate_prompt_logprobs("prefill", _scored(command.chunks, rejected), done.prompt_logprobs)
    return done


def validate_decode(command: Decode, replies: list[ReplyEnvelope], world_size: int) -> DecodeDone:
    done = validate_primary("decode", replies, world_size, DecodeDone)
    rejected = validate_rejected("decode", done.rejected, _rows(command.rows, set()))
    validate_tokens("decode", done.results, _rows(command.rows, rejected))
    return done


def validate_unified(command: Unified, replies: list[ReplyEnvelope], world_size: int) -> UnifiedDone:
    done = validate_primary("unified", replies, world_size, UnifiedDone)
    every = [chunk.request_id for chunk in command.prefill] + _rows(command.decode, set())
    rejected = validate_rejected("unified", done.rejected, every)
    validate_tokens("unified", done.decode, _rows(command.decode, rejected))
    validate_tokens("unified", done.prefill, _finals(command.prefill, rejected))
    validate_prompt_logprobs("unified", _scored(command.prefill, rejected), done.prompt_logprobs)
    return done


def validate_drop(command: DropRequest, replies: list[ReplyEnvelope], world_size: int) -> DropAck:
    """Every rank answers DropAck, and every rank's existence matches the expectation.

    A mixed answer, or a uniform wrong one, is lifecycle divergence even though every rank is
    now without the request.
    """
    op = COMMAND_NAMES[DropRequest]
    ordered = validate_rank_set(op, replies, world_size)
    existence: list[bool] = []
    for reply in ordered:
        if not isinstance(reply.body, DropAck):
            raise ReplyError(
                f"{op} rank {reply.rank} returned {reply_name(reply.body)} instead of drop acknowledgement"
            )
        existence.append(reply.body.existed)
    wanted = command.expectation is Expectation.MUST_EXIST
    if any(existed != wanted for existed in existence):
        raise ReplyError(
            f"{op} expected {EXPECTATION_NAMES[command.expectation]}, got rank existence {existence}"
        )
    return DropAck(wanted)


def _acks(command: Command, replies: list[ReplyEnvelope], world_size: int) -> Ack:
    return validate_acks(command_name(command), replies, world_size)


VALIDATORS: dict[type, Callable[[Any, list[ReplyEnvelope], int], StepReply]] = {
    Ping: _acks,
    Prefill: validate_prefill,
    Decode: validate_decode,
    Unified: validate_unified,
    DropRequest: validate_drop,
    Precapture: _acks,
    Shutdown: _acks,
}


def validate(command: Command, replies: list[ReplyEnvelope], world_size: int) -> StepReply:
    """The step's reply (rank 0's), once every rank's reply agrees with ``command``."""
    return VALIDATORS[type(command)](command, replies, world_size)


class RankFailed(Exception):
    """A rank answered ``Failed`` (or ``Refused``: it executed nothing); the text is the poison
    reason."""

    def __init__(self, op: str, rank: int, failed: Failed | Refused) -> None:
        if isinstance(failed, Refused):
            text = f"rank {rank} refused {op}, a command outside the wire limits: {failed.message}"
        else:
            text = f"rank {rank} failed during {op} ({failed.phase}): {failed.message}"
        super().__init__(text)
        self.rank = rank
        self.message = failed.message


class StepCollection:
    def __init__(self, op: str, seq: int, world_size: int) -> None:
        self.op = op
        self.seq = seq
        self.world_size = world_size
        self.replies: list[ReplyEnvelope] = []
        self.rejected = 0

    @property
    def done(self) -> bool:
        return len(self.replies) >= self.world_size

    def offer(self, reply: ReplyEnvelope) -> None:
        """Count ``reply`` if it belongs to this step; raise RankFailed on a Failed reply."""
        if isinstance(reply.body, Heartbeat):
            return
        if reply.seq != self.seq:
            self.rejected += 1
            log.warning(
                "stale reply rejected", op=self.op, reply_rank=reply.rank, reply_seq=reply.seq, seq=self.seq
            )
            return
        if isinstance(reply.body, Failed | Refused):
            raise RankFailed(self.op, reply.rank, reply.body)
        self.replies.append(reply)

    def missing_ranks(self) -> list[int]:
        answered = {reply.rank for reply in self.replies}
        return [rank for rank in range(self.world_size) if rank not in answered]
