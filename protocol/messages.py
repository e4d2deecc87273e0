"""Every command the coordinator sends and every reply a rank returns.

This module is the wire contract and its one import point. Each message is a frozen msgspec
Struct; the ones that travel as the body of an envelope are members of a tagged union (the tag
field is ``op``). Token ids and page tables travel packed as little-endian int32 bytes (see
``protocol.codec``), never as one msgpack object per token.

Lifecycle of a rank, as seen on the wire::

    rank  -> coordinator   Hello                        (signed: the rank's claim of its identity)
    coord -> that peer     Challenge(nonce)             (epoch: this launch's)
    rank  -> coordinator   Ready(capacity, nonce) | Failed(phase="startup:...")
    coord -> every rank    Go(effective capacity, dist init) | Cancel(reason)
    coord -> every rank    Envelope(Ping | Prefill | Decode | Unified | DropRequest | Precapture)*
    rank  -> coordinator   ReplyEnvelope(Ack | DropAck | PrefillDone | DecodeDone | UnifiedDone | Failed
                                         | Refused)
    coord -> every rank    Envelope(Shutdown)   (answered with Ack, then the rank exits)


Pipelined decode: the coordinator may send the next Decode or Unified before it has read the
previous one's result, so that the GPU never waits for the round trip. Such a step's rows carry
``FED_TOKEN`` instead of a token: each rank feeds the token that rank 0 sampled for the request in
the previous command (rank 0 shares it with the other ranks first); rows of requests whose first
token the coordinator has read carry it as usual. A request's first decode may follow its Prefill
that way too: the prompt's last chunk names the decode slot it feeds (``feed_slot``). Rank 0
answers a Decode or Unified as soon as its tokens are on the host. If the next command arrives
before that and is a Decode or Unified, rank 0 launches it first, then answers; any other command
runs only after the answer is out. Replies always leave a rank in seq order.

Where each message lives: the commands and the envelopes are defined here; the startup gate
(Hello ... Heartbeat) in ``protocol.handshake``, the replies in ``protocol.replies``, and the wire
limits with the value types every message shares (``SamplingParams``, ``Capacity``) in
``protocol.values``. This module re-exports all of them under ``__all__``, so that the lifecycle
above, this file and the three it names are the whole spec, and every caller imports each
message from here whatever file defines it.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from phalanx.protocol.handshake import Cancel, Challenge, Go, Heartbeat, Hello, Ready
from phalanx.protocol.replies import (
    REPLY_NAMES,
    Ack,
    DecodeDone,
    DropAck,
    Failed,
    PrefillDone,
    PromptLogprobs,
    RankMessage,
    Refused,
    Reply,
    RequestRejected,
    TokenResult,
    UnifiedDone,
)
from phalanx.protocol.values import (
    GREEDY_BELOW,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    Capacity,
    Count,
    Int32,
    Int64,
    RequestId,
    SamplingParams,
)

# 2: pipelined decode (FED_TOKEN rows); 3: a prefill feeds the first decode;
# 4: SamplingParams carries min_p, logit_bias and banned ids (min_tokens);
# 5: prompt logprobs (PrefillChunk.prompt_logprobs and next_token, PromptLogprobs in the replies);
# 6: constrained output (PrefillChunk.grammar); 7: bounded values, the Hello / Challenge handshake;
# 8: prefix caching (PrefillChunk.restore and .save, Capacity.snapshot_slots);
# 9: per-request rejections (RequestRejected in PrefillDone, DecodeDone and UnifiedDone)
PROTOCOL_VERSION = 9

# ---------------------------------------------------------------------------------------------
# Commands (coordinator -> every rank)
# ---------------------------------------------------------------------------------------------


NO_FEED = -1
"""``PrefillChunk.feed_slot`` of a chunk that feeds no decode slot."""

NO_TOKEN = -1
"""``PrefillChunk.next_token`` of a prompt's last chunk: no prompt token follows it."""


class StateSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """A request's linear-attention state (every Gated DeltaNet layer's conv and recurrent state)
    after its first ``position`` prompt tokens, kept in snapshot slot ``slot`` under ``key``.

    Snapshot slots are state slots of their own (``Capacity.snapshot_slots`` of them) beside the
    decode and staging slots. The coordinator owns them: it picks the slot, and ``key`` is its
    name for the cached prefix (a hash of the prefix's tokens). A rank remembers which key and
    position each of its snapshot slots holds, and refuses a restore that names another.
    """

    slot: Count
    key: Int64
    position: Count


SNAPSHOT_GRID = 64
"""Where a save costs a rank nothing: at a multiple of this many tokens past its chunk's start, a
rank takes the snapshot within the chunk's own pass (the chunked delta rule holds the state at
every 64th token anyway). A save anywhere else is exact too, but the rank then runs the rest of
the chunk as a second pass."""


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

    Prefix caching. ``restore`` (a request's first chunk only, None otherwise): the request starts
    from a cached prefix instead of position 0. ``start`` equals ``restore.position``; the first
    ``start / page_size`` pages of ``page_ids`` are the prefix's cached KV pages (other requests
    may share them: a rank never writes a page below ``start``); the rank copies the snapshot into
    the request's staging state before any model work of the command. ``save``: positions in
    ``(start, start + len(tokens)]``, ascending, at which the rank copies the request's state into
    the named snapshot slot (overwriting what it held: the coordinator evicted it), after every
    restore of the command. A chunk that saves may not ask for prompt logprobs.
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
    restore: StateSnapshot | None = None
    save: list[StateSnapshot] = []


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
    """Prefill chunks and decode rows of disjoint requests in one step; workers launch the decode
    part first, so its graph replay runs on the GPU while they launch the prefill's kernels."""

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


# Every message and shared value of the wire, wherever it is defined.
__all__ = [
    "Ack",
    "COMMAND_NAMES",
    "Cancel",
    "Capacity",
    "Capture",
    "Challenge",
    "Command",
    "CoordinatorMessage",
    "Count",
    "Decode",
    "DecodeDone",
    "DecodeRow",
    "DropAck",
    "DropRequest",
    "Envelope",
    "Expectation",
    "FED_TOKEN",
    "Failed",
    "Finalize",
    "GREEDY_BELOW",
    "Go",
    "Heartbeat",
    "Hello",
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "Int32",
    "Int64",
    "Launch",
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "NO_FEED",
    "NO_TOKEN",
    "PROTOCOL_VERSION",
    "Ping",
    "Precapture",
    "PrecapturePhase",
    "Prefill",
    "PrefillChunk",
    "PrefillDone",
    "PromptLogprobs",
    "REPLY_NAMES",
    "RankMessage",
    "Ready",
    "Refused",
    "Reply",
    "ReplyEnvelope",
    "RequestId",
    "RequestRejected",
    "SamplingParams",
    "Shutdown",
    "SNAPSHOT_GRID",
    "SlotMove",
    "StateSnapshot",
    "TokenResult",
    "Unified",
    "UnifiedDone",
    "Warmup",
]
