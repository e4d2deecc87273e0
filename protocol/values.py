"""Wire limits and the value types that every message shares (see ``protocol.messages``).

Wire limits: every integer is bounded by its Meta annotation (token ids, positions, slots and
counts fit int32; request ids and seeds int64), temperatures are finite and at most
``MAX_TEMPERATURE``, ``top_p`` is in (0, 1]. ``protocol.codec.encode`` refuses a command outside
them before it is sent, and a rank's decoder refuses a frame outside them, so no value that a
rank cannot compute with ever reaches it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

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
    snapshot_slots is the number of prefix-cache state snapshots (``StateSnapshot``) the rank
    keeps; 0 turns prefix caching off.
    """

    kv_pages: Count
    page_size: Count
    max_slots: Count
    max_batch_tokens: Count
    snapshot_slots: Count = 0
