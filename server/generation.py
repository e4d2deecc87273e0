"""One request through the engine, as text: detokenized, cut at stop strings, timed for metrics.

``start`` submits at once, so a prompt the engine refuses is a 400 before any response is sent.
Iterating the Generation yields ``Chunk``s and then one ``Done``. Whoever stops iterating early
(a client that went away, a stop string) cancels the engine request, which frees its slot and
pages.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from phalanx.engine.engine import (
    Engine,
    ErrorEvent,
    FinishEvent,
    GenerationParams,
    PromptLogprobsEvent,
    RequestStream,
    TokenEvent,
)
from phalanx.server.access_log import current_usage
from phalanx.server.detokenizer import IncrementalDetokenizer, StopMatcher, TextTokenizer
from phalanx.server.metrics import ServerMetrics


class GenerationError(RuntimeError):
    """The engine ended the request with an error (for example: the engine is poisoned).
    ``rejected``: a rank could not serve one of the request's own values (a 400, not the server's
    fault)."""

    def __init__(self, message: str, rejected: bool = False) -> None:
        super().__init__(message)
        self.rejected = rejected


@dataclass(frozen=True)
class TokenInfo:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    text_offset: int = 0  # characters of the generated text before this token's


@dataclass(frozen=True)
class PromptToken:
    """A prompt token's logprob given the tokens before it (the first prompt token has none)."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]] | None


@dataclass
class PromptScores:
    tokens: list[PromptToken]


@dataclass(frozen=True)
class StopRule:
    """How the text ends: stop strings (kept in the text with ``include``), checked only once
    ``min_tokens`` tokens are out; a stop token id's own text shows only with ``include``."""

    strings: list[str] = field(default_factory=list)
    include: bool = False
    min_tokens: int = 0


@dataclass
class Chunk:
    text: str
    tokens: list[TokenInfo] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


class Generation:
    def __init__(
        self,
        engine: Engine,
        tokenizer: TextTokenizer,
        metrics: ServerMetrics,
        prompt_ids: list[int],
        params: GenerationParams,
        stop: StopRule,
    ) -> None:
        self._started = time.monotonic()
        self._engine = engine
        self._metrics = metrics
        self._prompt_ids = prompt_ids
        self._prompt_tokens = len(prompt_ids)
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._rule = stop
        self._stops = StopMatcher(stop.strings, stop.include)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._text_length = 0  # characters the detokenizer has given so far
        self._usage = current_usage()  # the access log's record of the HTTP request, if any
        # raises ValueError (bad input) or RuntimeError (engine closed) before anything is queued
        self._stream: RequestStream = engine.submit(prompt_ids, params)
        # a response that is dropped before it ever reads the stream (the client left before the
        # first byte) must still free the request's slot and pages
        self._cancel_if_dropped = weakref.finalize(self, engine.cancel, self._stream.request_id)

    @property
    def request_id(self) -> int:
        return self._stream.request_id

    async def __aiter__(self) -> AsyncIterator[PromptScores | Chunk | Done]:
        ended = False
        timing = _Timing(self._started)
        try:
            async for event in self._stream:
                if isinstance(event, PromptLogprobsEvent):
                    yield self._prompt_scores(event)
                elif isinstance(event, TokenEvent):
                    timing.token()
                    self._metrics.token(self._prompt_tokens if timing.count == 1 else 0)
                    offset = self._text_length
                    text = self._stops.push(
                        self._token_text(event.token_id), timing.count >= self._rule.min_tokens
                    )
                    info = TokenInfo(event.token_id, event.logprob, event.top_logprobs, offset)
                    yield Chunk(text, [info])
                    if self._stops.stopped:
                        self._engine.cancel(self.request_id)
                        ended = self._ended()
                        yield self._done(timing, "stop")
                        return
                elif isinstance(event, FinishEvent):
                    ended = self._ended()
                    if timing.count == 0 and event.reason != "cancelled":  # a prompt-only request
                        self._metrics.prompt(self._prompt_tokens)
                    tail = self._stops.push(self._detokenizer.flush()) + self._stops.flush()
                    if tail:
                        yield Chunk(tail)
                    yield self._done(timing, "stop" if self._stops.stopped else event.reason)
                    return
                elif isinstance(event, ErrorEvent):
                    ended = self._ended()
                    self._metrics.finished("error")
                    raise GenerationError(event.message, event.rejected)
        finally:
            if not ended:  # the consumer left early: a client disconnect or a cancelled task
                self._engine.cancel(self.request_id)
                self._metrics.finished("cancelled")
            if self._usage is not None:
                self._usage.record(self._prompt_tokens, timing.count, timing.ttft)

    def _prompt_scores(self, event: PromptLogprobsEvent) -> PromptScores:
        tops = event.top_logprobs or [None] * len(event.logprobs)
        ids = self._prompt_ids[event.start : event.start + len(event.logprobs)]
        return PromptScores(
            [PromptToken(*scored) for scored in zip(ids, event.logprobs, event.ranks, tops, strict=True)]
        )

    def _token_text(self, token_id: int) -> str:
        if token_id in self._stop_token_ids and not self._rule.include:
            return ""  # a stop id ends the request (the scheduler sees to it) and is not shown
        delta = self._detokenizer.push(token_id)
        self._text_length += len(delta)
        return delta

    def _ended(self) -> bool:
        self._cancel_if_dropped.detach()
        return True

    def _done(self, timing: _Timing, reason: str) -> Done:
        self._metrics.finished(reason, timing.ttft, timing.tpot)
        return Done(reason, self._prompt_tokens, timing.count)


class _Timing:
    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0

    def token(self) -> None:
        now = time.monotonic()
        self.first = self.first or now
        self.last = now
        self.count += 1

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.started

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.count < 2:
            return None
        return (self.last - self.first) / (self.count - 1)
