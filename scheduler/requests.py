"""A request as the scheduler tracks it, its generation parameters and the request id allocator."""

from __future__ import annotations

import enum
import itertools
import math
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from phalanx.protocol.messages import (
    GREEDY_BELOW,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_TEMPERATURE,
    SamplingParams,
)
from phalanx.scheduler.events import Event
from phalanx.scheduler.prefix_cache import PrefixState


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationParams:
    """Per-request generation settings. temperature 0 is greedy; top_k 0 and top_p 1 disable them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    stop_token_ids: tuple[int, ...] = ()  # ids that end the request like an end-of-sequence token
    min_tokens: int = 0  # no end-of-sequence or stop id before this many output tokens
    prompt_logprobs: int | None = None  # None: none; N: each prompt token's logprob and the top N
    grammar: str | None = None  # an llguidance grammar the output must follow (rank 0 masks the rest)

    def validate(self, vocab_size: int, least_max_tokens: int = 1) -> None:
        """Raise ValueError naming the first bad field; ``least_max_tokens`` 0 lets a request
        generate nothing (the engine scores such a prompt alone)."""
        if not _is_int(self.max_tokens) or not least_max_tokens <= self.max_tokens <= INT32_MAX:
            raise ValueError(
                f"max_tokens must be an integer in [{least_max_tokens}, {INT32_MAX}], got {self.max_tokens!r}"
            )
        if not math.isfinite(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(
                f"top_k must be an integer in [0, {INT32_MAX}] (0 disables it), got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            for token in ids:
                if not _is_int(token) or not 0 <= token < vocab_size:
                    raise ValueError(
                        f"{name}: token id {token!r} is outside the vocabulary [0, {vocab_size})"
                    )
        if any(not math.isfinite(bias) for bias in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be finite numbers")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")

    def sampling(self, prompt_length: int, eos_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The parameters the ranks sample with. A request that samples (temperature > 0) without a
        seed gets one drawn here, once: the coordinator owns that decision like every other, so rank
        0's draws follow from the commands alone and a recorded trace replays token for token.
        ``min_tokens`` becomes a ban of the ids that would end the request, up to the position of
        its last required token."""
        # a temperature too small to divide by is greedy (protocol.messages.GREEDY_BELOW)
        temperature = 0.0 if self.temperature < GREEDY_BELOW else float(self.temperature)
        seed = self.seed
        if seed is None and temperature > 0:
            seed = secrets.randbits(63)
        ending = sorted({*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids)})
        banned = self.min_tokens > 0 and ending
        return SamplingParams(
            temperature=temperature,
            top_k=self.top_k,
            top_p=float(self.top_p),
            seed=seed,
            logprobs=self.logprobs,
            min_p=float(self.min_p),
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
            banned_ids=ending if banned else None,
            banned_until=prompt_length + self.min_tokens if banned else 0,
        )


class Phase(enum.Enum):
    WAITING = "waiting"  # queued; nothing reserved, nothing sent to the ranks
    PREFILLING = "prefilling"  # slot and pages reserved; prompt tokens before ``cursor`` sent or cached
    READY = "ready"  # prompt cached, first token sampled; state still prefill-owned on the ranks
    DECODING = "decoding"  # holds a dense decode slot
    DONE = "done"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt: list[int]
    params: GenerationParams
    emit: Callable[[Event], None]
    eos_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(init=False)
    phase: Phase = Phase.WAITING
    pages: list[int] = field(default_factory=list)
    cursor: int = 0  # prompt tokens already sent to the ranks (or restored from the prefix cache)
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    prefix: PrefixState = field(default_factory=PrefixState)

    def __post_init__(self) -> None:
        self.sampling = self.params.sampling(len(self.prompt), self.eos_token_ids)

    @property
    def kv_tokens(self) -> int:
        """Positions this request can ever cache: the last sampled token is never fed back."""
        return len(self.prompt) + self.params.max_tokens - 1

    @property
    def next_position(self) -> int:
        """Position of the token the next decode row feeds (the last output token)."""
        return len(self.prompt) + len(self.output) - 1


class RequestIds:
    """Thread-safe request id allocator; ids start at 1 and are never 0."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            return next(self._counter)
