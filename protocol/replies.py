"""What a rank answers to each command (see ``protocol.messages`` for the commands).

Rank 0 is the primary: it samples and returns the token payloads; every other rank answers a
Prefill/Decode/Unified with Ack. A DropRequest is answered with DropAck by every rank.

Per-request rejection. A value inside the wire limits that a rank still cannot compute with fails
its request alone, never the rank: a token id outside the model's vocabulary (a chunk's tokens or
``next_token``, a decode row's token, a ``logit_bias`` or banned id) or a grammar rank 0 cannot
compile. Every rank checks a command's values before any of its model work (the vocabulary checks
alike on every rank, the grammar on rank 0 alone) and still runs the request's chunk or row, with
token 0 in place of each bad id and the bad sampling ids left out, so every rank runs the same
batch. Rank 0 then answers the request in ``rejected`` instead of with its token and prompt
logprobs. The request's rank state is what the command would have left, so the coordinator fails
that request alone and drops it (DropRequest, MustExist, with its slot compaction) as any other.
A step sent before the rejection was read (pipelined, ``FED_TOKEN``) runs the request's row as
usual: rank 0 answers it with a token, or rejects it again while its values stay bad, and the
coordinator discards either.
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


class RequestRejected(msgspec.Struct, frozen=True, array_like=True):
    """A request of the command that rank 0 cannot serve: ``reason`` names the value and why."""

    request_id: RequestId
    reason: str


class Ack(msgspec.Struct, frozen=True, tag="ack", tag_field="op"):
    pass


class DropAck(msgspec.Struct, frozen=True, tag="drop_ack", tag_field="op"):
    existed: bool


class PrefillDone(msgspec.Struct, frozen=True, tag="prefill_done", tag_field="op"):
    """One result per chunk marked ``last``; earlier chunks produce nothing. One
    ``PromptLogprobs`` per chunk that asked for them, in chunk order. A rejected request has
    neither: it is in ``rejected`` (once per command, whichever chunk or row rank 0 judged)."""

    results: list[TokenResult]
    prompt_logprobs: list[PromptLogprobs] = []
    rejected: list[RequestRejected] = []


class DecodeDone(msgspec.Struct, frozen=True, tag="decode_done", tag_field="op"):
    results: list[TokenResult]
    rejected: list[RequestRejected] = []


class UnifiedDone(msgspec.Struct, frozen=True, tag="unified_done", tag_field="op"):
    prefill: list[TokenResult]
    decode: list[TokenResult]
    prompt_logprobs: list[PromptLogprobs] = []
    rejected: list[RequestRejected] = []


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
    limits (``message`` says where). The rank changed nothing and is not poisoned. The coordinator
    poisons all the same: its encoder refuses such a command, so one that arrives means the two
    sides disagree on the wire (a bug or version skew), and the steps it may have pipelined behind
    it were planned on effects the ranks never had."""

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
