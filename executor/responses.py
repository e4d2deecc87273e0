"""Validation of one step's reply set. The error texts are part of the contract (tests assert them).

A step's replies are collected first (exactly ``world_size`` of them carrying the step's seq and
epoch, see :mod:`executor.collect`), then checked here: every rank exactly once, rank 0 carries
the primary result and every other rank an Ack, or for a drop every rank a DropAck that agrees
with the expectation.
"""

from __future__ import annotations

from typing import TypeVar

from phalanx.executor.errors import ResponseError
from phalanx.protocol.messages import (
    REPLY_NAMES,
    Ack,
    DecodeDone,
    DropAck,
    Expectation,
    PrefillDone,
    ReplyEnvelope,
    UnifiedDone,
)

T = TypeVar("T")

# How each expectation is spelled in error texts.
EXPECTATION_NAMES: dict[Expectation, str] = {
    Expectation.MUST_EXIST: "MustExist",
    Expectation.MUST_BE_ABSENT: "MustBeAbsent",
}

DROP_OP = "drop request"


def reply_name(body: object) -> str:
    return REPLY_NAMES.get(type(body), type(body).__name__)


def validate_rank_set(op: str, replies: list[ReplyEnvelope], world_size: int) -> list[ReplyEnvelope]:
    """Every rank exactly once; returns the replies sorted by rank."""
    if len(replies) != world_size:
        raise ResponseError(f"{op} expected {world_size} responses, got {len(replies)}")
    seen: set[int] = set()
    for reply in replies:
        if not 0 <= reply.rank < world_size:
            raise ResponseError(f"{op} returned out-of-range rank {reply.rank} for world size {world_size}")
        if reply.rank in seen:
            raise ResponseError(f"{op} returned duplicate rank {reply.rank}")
        seen.add(reply.rank)
    return sorted(replies, key=lambda reply: reply.rank)


def validate_acks(op: str, replies: list[ReplyEnvelope], world_size: int) -> None:
    """Ping, Precapture, Shutdown: every rank answers Ack."""
    for reply in validate_rank_set(op, replies, world_size):
        if not isinstance(reply.body, Ack):
            raise ResponseError(
                f"{op} rank {reply.rank} returned {reply_name(reply.body)} instead of acknowledgement"
            )


def validate_primary(op: str, replies: list[ReplyEnvelope], world_size: int, primary: type[T]) -> T:
    """Prefill, Decode, Unified: rank 0 returns the typed result, every other rank Ack."""
    ordered = validate_rank_set(op, replies, world_size)
    first = ordered[0].body
    if not isinstance(first, primary):
        raise ResponseError(f"{op} rank 0 returned {reply_name(first)} instead of primary {op} result")
    for reply in ordered[1:]:
        if not isinstance(reply.body, Ack):
            raise ResponseError(
                f"{op} non-primary rank {reply.rank} returned {reply_name(reply.body)} "
                "instead of acknowledgement"
            )
    return first


def validate_prefill(replies: list[ReplyEnvelope], world_size: int) -> PrefillDone:
    return validate_primary("prefill", replies, world_size, PrefillDone)


def validate_decode(replies: list[ReplyEnvelope], world_size: int) -> DecodeDone:
    return validate_primary("decode", replies, world_size, DecodeDone)


def validate_unified(replies: list[ReplyEnvelope], world_size: int) -> UnifiedDone:
    return validate_primary("unified", replies, world_size, UnifiedDone)


def validate_drop(expectation: Expectation, replies: list[ReplyEnvelope], world_size: int) -> None:
    """Every rank answers DropAck, and every rank's existence matches the expectation.

    A mixed answer, or a uniform wrong one, is lifecycle divergence even though every rank is
    now without the request.
    """
    ordered = validate_rank_set(DROP_OP, replies, world_size)
    existence: list[bool] = []
    for reply in ordered:
        if not isinstance(reply.body, DropAck):
            raise ResponseError(
                f"{DROP_OP} rank {reply.rank} returned {reply_name(reply.body)} "
                "instead of drop acknowledgement"
            )
        existence.append(reply.body.existed)
    wanted = expectation is Expectation.MUST_EXIST
    if any(existed != wanted for existed in existence):
        raise ResponseError(
            f"drop request expected {EXPECTATION_NAMES[expectation]}, got rank existence {existence}"
        )
