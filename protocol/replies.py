"""What a rank answers to each command (see ``protocol.messages`` for the commands).

Rank 0 is the primary: it samples and returns the token payloads; every other rank answers a
Prefill/Decode/Unified with Ack. A DropRequest is answered with DropAck by every rank.
"""

from __future__ import annotations

import msgspec

from phalanx.protocol.handshake import Heartbeat, Hello, Ready
from phalanx.protocol.values import Int32, RequestId


class TokenResult(msgspec.Struct, frozen=True, array_like=True):
    """A sampled token. ``logprob`` and the top lists are present when the row asked for them."""

    request_id: RequestId
    token: Int32
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A chunk's prompt logprobs: ``logprobs[i]`` is that of the prompt token at position
    ``start + i`` given the tokens before it, ``ranks[i]`` its rank (1 + the number of ids with a
    higher logit); the top lists are present when N > 0."""

    request_id: int
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


class Ack(msgspec.Struct, frozen=True, tag="ack", tag_field="op"):
    pass


class DropAck(msgspec.Struct, frozen=True, tag="drop_ack", tag_field="op"):
    existed: bool


class PrefillDone(msgspec.Struct, frozen=True, tag="prefill_done", tag_field="op"):
    """One result per chunk marked ``last``; earlier chunks produce nothing. One
    ``PromptLogprobs`` per chunk that asked for them, in chunk order."""

    results: list[TokenResult]
    prompt_logprobs: list[PromptLogprobs] = []


class DecodeDone(msgspec.Struct, frozen=True, tag="decode_done", tag_field="op"):
    results: list[TokenResult]


class UnifiedDone(msgspec.Struct, frozen=True, tag="unified_done", tag_field="op"):
    prefill: list[TokenResult]
    decode: list[TokenResult]
    prompt_logprobs: list[PromptLogprobs] = []


class Failed(msgspec.Struct, frozen=True, tag="failed", tag_field="op"):
    """The rank could not carry out a command (or start): it has poisoned itself and exits.

    ``kind`` classifies the failure ("startup", "state", "execution", "protocol", "timeout");
    ``phase`` names where it happened ("startup:load", "startup:dist_init", "decode", ...).
    """

    kind: str
    message: str
    phase: str
    traceback: str = ""


class Refused(msgspec.Struct, frozen=True, tag="refused", tag_field="op"):
    """The rank executed nothing of the command with this seq: a value in it is outside the wire
    limits (``message`` says where). The rank changed nothing and is not poisoned; the coordinator,
    which should never have sent it, decides what follows."""

    message: str


Reply = Ack | DropAck | PrefillDone | DecodeDone | UnifiedDone | Failed | Refused
RankMessage = Reply | Hello | Ready | Heartbeat

# Names used in validation error texts ("... returned {name} instead of ...").
REPLY_NAMES: dict[type, str] = {
    Ack: "acknowledgement",
    DropAck: "drop acknowledgement",
    PrefillDone: "prefill result",
    DecodeDone: "decode result",
    UnifiedDone: "unified result",
    Failed: "failure",
    Refused: "refusal",
    Hello: "hello",
    Ready: "ready",
    Heartbeat: "heartbeat",
}
