"""Every command the coordinator sends and every reply a rank returns.

This file is the wire contract. Each message is a frozen msgspec Struct; the ones that travel
as the body of an envelope are members of a tagged union (the tag field is ``op``). Token ids
and page tables travel packed as little-endian int32 bytes (see ``protocol.packing``), never as
one msgpack object per token.

Lifecycle of a rank, as seen on the wire::

    rank  -> coordinator   Hello                        (signed: the rank's claim of its identity)
    coord -> that peer     Challenge(nonce)             (epoch: this launch's)
    rank  -> coordinator   Ready(capacity, nonce) | Failed(phase="startup:...")
    coord -> every rank    Go(effective capacity, dist init) | Cancel(reason)
    coord -> every rank    Envelope(Ping | Prefill | Decode | Unified | DropRequest | Precapture)*
    rank  -> coordinator   ReplyEnvelope(Ack | DropAck | PrefillDone | DecodeDone | UnifiedDone | Failed
                                         | Refused)
    coord -> every rank    Envelope(Shutdown)   (answered with Ack, then the rank exits)

The handshake binds a rank to the connection it speaks on: the coordinator answers each signed
Hello with a fresh nonce for that connection only, and takes the first Ready that is signed by the
rank, carries this launch's epoch and echoes the nonce sent on the same connection; from then on
that rank's commands go to that connection alone. A second claim of a bound rank, a Ready whose
nonce does not match (a replayed hello) and a peer that never sent a signed Hello get nothing.

Rank 0 is the primary: it samples and returns the token payloads; every other rank answers a
Prefill/Decode/Unified with Ack. A DropRequest is answered with DropAck by every rank.

Pipelined decode: the coordinator may send the next Decode or Unified before it has read the
previous one's result, so that the GPU never waits for the round trip. Such a step's rows carry
``FED_TOKEN`` instead of a token: each rank feeds the token that rank 0 sampled for the request in
the previous command (rank 0 shares it with the other ranks first); rows of requests whose first
token the coordinator has read carry it as usual. A request's first decode may follow its Prefill
that way too: the prompt's last chunk names the decode slot it feeds (``feed_slot``). Rank 0
answers a Decode or Unified as soon as its tokens are on the host. If the next command arrives
before that and is a Decode or Unified, rank 0 launches it first, then answers; any other command
runs only after the answer is out. Replies always leave a rank in seq order.

Wire limits: every integer is bounded by its Meta annotation (token ids, positions, slots and
counts fit int32; request ids and seeds int64), temperatures are finite and at most
``MAX_TEMPERATURE``, ``top_p`` is in (0, 1]. ``protocol.codec.encode`` refuses a command outside
them before it is sent, and a rank's decoder refuses a frame outside them, so no value that a
rank cannot compute with ever reaches it.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

# 2: pipelined decode (FED_TOKEN rows); 3: a prefill feeds the first decode;
# 4: SamplingParams carries min_p, logit_bias and banned ids (min_tokens);
# 5: prompt logprobs (PrefillChunk.prompt_logprobs and next_token, PromptLogprobs in the replies);
# 6: constrained output (PrefillChunk.grammar); 7: bounded values, the Hello / Challenge handshake
PROTOCOL_VERSION = 7

INT32_MAX = (1 << 31) - 1
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily: dividing logits by it would overflow to inf."""

Int32 = Annotated[int, msgspec.Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
RequestId = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]

# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """How rank 0 picks a request's next token.

    temperature 0 (or below ``GREEDY_BELOW``) means greedy (ties go to the smallest id). top_k 0 and top_p 1.0 disable those
    filters. With a seed, the draw depends only on (seed, position), never on the batch. The
    coordinator gives every request that samples a seed (its own, or one it draws), so a command
    fixes its tokens; a command without one (only a hand-made trace sends it) draws unseeded.
    logprobs None returns no logprobs; N >= 0 returns the chosen token's logprob and the top N.

    min_p 0 disables it; else a token stays only if its probability (after temperature) is at
    least min_p times the most likely token's. ``logit_bias`` (token id -> bias) is added to the
    logits before the pick, greedy or not. ``banned_ids`` are never picked for a position below
    ``banned_until`` (a minimum output length keeps the stop tokens out until it is reached).
    Reported logprobs stay those of the raw distribution, before bias and bans.
    """

    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)] = 0.0
    top_k: Count = 0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    seed: Int64 | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    logit_bias: dict[Count, Annotated[float, msgspec.Meta(ge=-100.0, le=100.0)]] | None = None
    banned_ids: list[Count] | None = None
    banned_until: Count = 0


class Capacity(msgspec.Struct, frozen=True):
    """What one rank can hold. The coordinator takes the element-wise minimum over ranks.

    kv_pages excludes the rank's reserved padding page. max_slots is the number of dense decode
    slots (and of prefill staging states). max_batch_tokens bounds the tokens of one prefill step.
    """

    kv_pages: Count
    page_size: Count
    max_slots: Count
    max_batch_tokens: Count


# ---------------------------------------------------------------------------------------------
# Startup gate
# ---------------------------------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, tag="hello", tag_field="op"):
    """A rank's first frame on its connection: it claims its rank (the envelope's, signed)."""


class Challenge(msgspec.Struct, frozen=True, tag="challenge", tag_field="op"):
    """The answer to a Hello, on that connection only: its Ready must echo ``nonce``."""

    nonce: bytes


class Ready(msgspec.Struct, frozen=True, tag="ready", tag_field="op"):
    """A rank bound its device, loaded its shard and sized its capacity. ``nonce`` is its
    connection's Challenge, so a Ready recorded in another launch or on another connection is
    refused."""

    capacity: Capacity
    device: str
    pid: int
    host: str
    nonce: bytes = b""


class Go(msgspec.Struct, frozen=True, tag="go", tag_field="op"):
    """Start distributed init with this effective capacity (the minimum over ranks).

    ``collective_timeout`` (seconds; 0: the rank's own startup timeout) bounds every collective of
    the process group. The coordinator sets it below its step timeout, so that a rank left waiting
    for a hung peer fails (and the coordinator names the peer) before the step's deadline."""

    capacity: Capacity
    dist_init_method: str
    dist_backend: str
    collective_timeout: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0


class Cancel(msgspec.Struct, frozen=True, tag="cancel", tag_field="op"):
    """Startup failed somewhere: exit without entering distributed init."""

    reason: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat", tag_field="op"):
    """Sent periodically by ranks the coordinator did not spawn, so it can notice them die."""

    unix_time: float


# ---------------------------------------------------------------------------------------------
# Commands (coordinator -> every rank)
# ---------------------------------------------------------------------------------------------


NO_FEED = -1
"""``PrefillChunk.feed_slot`` of a chunk that feeds no decode slot."""

NO_TOKEN = -1
"""``PrefillChunk.next_token`` of a prompt's last chunk: no prompt token follows it."""


class PrefillChunk(msgspec.Struct, frozen=True, array_like=True):
    """One contiguous piece of one request's prompt.

    ``start`` is the position of the chunk's first token (tokens already in the cache); the
    first chunk of a request has start 0. ``page_ids`` is the request's whole page table so far
    (packed int32), covering positions ``[0, start + len(tokens))``. On the ``last`` chunk rank 0
    samples the request's first output token.

    ``feed_slot`` (a Prefill's last chunks only, else ``NO_FEED``): the dense decode slot the
    request's first decode row will use. Every rank keeps the sampled token for that slot, so the
    next command may be that Decode with the row ``FED_TOKEN``, sent before this Prefill's answer
    is read. The slot must be free: no request is decoding in it.

    ``prompt_logprobs`` N (None: not asked): rank 0 answers a ``PromptLogprobs`` for the chunk:
    each prompt token after the chunk's first position, given the tokens before it, up to and
    including ``next_token`` (the prompt token right after the chunk, ``NO_TOKEN`` on the last
    chunk; read only when prompt logprobs are asked), with the top N. The ranks compute it on their vocabulary shards: only each position's
    log-normaliser, the scored token's logit and each shard's top N cross between ranks.

    ``grammar`` (a prompt's last chunk only): an llguidance grammar (its serialized JSON, or Lark
    text) the request's output must follow. Rank 0 keeps a matcher for the request from this
    chunk until its DropRequest: each token it samples for the request, at this chunk and at every
    decode row, is one the grammar allows at that point (end-of-sequence once it is complete).
    """

    request_id: RequestId
    tokens: bytes
    start: Count
    page_ids: bytes
    last: bool
    sampling: SamplingParams = SamplingParams()
    feed_slot: Int32 = NO_FEED
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    next_token: Int32 = NO_TOKEN
    grammar: str | None = None


FED_TOKEN = -1
"""``DecodeRow.token`` of a pipelined step: feed the token sampled for this request by the previous
command, which must have been a Decode or Unified with a decode row of the request in the same
slot, or a Prefill whose last chunk of the request named that slot as its ``feed_slot``."""


class DecodeRow(msgspec.Struct, frozen=True, array_like=True):
    """One request's decode step: feed ``token`` at ``position`` from dense slot ``slot``.

    ``token`` is ``FED_TOKEN`` when the coordinator has not read the previous step's result yet.
    On a request's first decode row the worker moves its prefill-owned state into ``slot``.
    """

    request_id: RequestId
    slot: Count
    token: Int32
    position: Count
    page_ids: bytes
    sampling: SamplingParams = SamplingParams()


class Expectation(enum.Enum):
    MUST_EXIST = "must_exist"
    MUST_BE_ABSENT = "must_be_absent"


class SlotMove(msgspec.Struct, frozen=True, array_like=True):
    """Compaction that accompanies a retirement: ``request_id`` moves ``from_slot -> to_slot``."""

    request_id: RequestId
    from_slot: Count
    to_slot: Count


class Ping(msgspec.Struct, frozen=True, tag="ping", tag_field="op"):
    pass


class Prefill(msgspec.Struct, frozen=True, tag="prefill", tag_field="op"):
    chunks: list[PrefillChunk]


class Decode(msgspec.Struct, frozen=True, tag="decode", tag_field="op"):
    rows: list[DecodeRow]


class Unified(msgspec.Struct, frozen=True, tag="unified", tag_field="op"):
    """Prefill chunks and decode rows in one step; workers run the prefill part first."""

    prefill: list[PrefillChunk]
    decode: list[DecodeRow]


class DropRequest(msgspec.Struct, frozen=True, tag="drop", tag_field="op"):
    request_id: RequestId
    expectation: Expectation
    move: SlotMove | None = None


class Warmup(msgspec.Struct, frozen=True, tag="warmup", tag_field="phase"):
    """One eager all-reduce per bucket size, so no collective connects lazily inside a capture."""


class Capture(msgspec.Struct, frozen=True, tag="capture", tag_field="phase"):
    bucket: Count


class Launch(msgspec.Struct, frozen=True, tag="launch", tag_field="phase"):
    bucket: Count


class Finalize(msgspec.Struct, frozen=True, tag="finalize", tag_field="phase"):
    """Every reachable bucket must be captured now; serving is replay-only from here."""


PrecapturePhase = Warmup | Capture | Launch | Finalize


class Precapture(msgspec.Struct, frozen=True, tag="precapture", tag_field="op"):
    phase: PrecapturePhase


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown", tag_field="op"):
    pass


Command = Ping | Prefill | Decode | Unified | DropRequest | Precapture | Shutdown
CoordinatorMessage = Command | Challenge | Go | Cancel

# How each command is named in error texts and logs.
COMMAND_NAMES: dict[type, str] = {
    Ping: "ping",
    Prefill: "prefill",
    Decode: "decode",
    Unified: "unified",
    DropRequest: "drop request",
    Precapture: "precapture",
    Shutdown: "shutdown",
}

# ---------------------------------------------------------------------------------------------
# Replies (every rank -> coordinator)
# ---------------------------------------------------------------------------------------------


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

# ---------------------------------------------------------------------------------------------
# Envelopes
# ---------------------------------------------------------------------------------------------


class Envelope(msgspec.Struct, frozen=True):
    """What the coordinator sends. ``epoch`` identifies one launch; ``seq`` grows by one per
    dispatched command (startup messages use seq 0)."""

    proto: Int64
    epoch: Int64
    seq: Int64
    body: CoordinatorMessage


class ReplyEnvelope(msgspec.Struct, frozen=True):
    """What a rank sends back, echoing the envelope's epoch and seq."""

    proto: Int64
    epoch: Int64
    rank: Count
    seq: Int64
    body: RankMessage
