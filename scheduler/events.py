"""What a request's stream yields: prompt logprobs if asked, tokens, then exactly one final event
(finish or error)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. An end-of-sequence token that stops the request is reported too."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class PromptLogprobsEvent:
    """Logprobs of prompt tokens from position ``start`` on, each given the tokens before it, their
    ranks, and the top N as (id, logprob); a request that asked gets them all before its first token."""

    start: int
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed. ``rejected``: a rank could not serve one of the request's own values
    (``protocol.replies``), so the fault is the request's and the replica serves on."""

    message: str
    rejected: bool = False


Event = TokenEvent | PromptLogprobsEvent | FinishEvent | ErrorEvent


def is_final(event: Event) -> bool:
    return isinstance(event, FinishEvent | ErrorEvent)
