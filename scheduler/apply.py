"""Applying a step's reply to request state, and retiring the requests it finished.

The executor has already checked the reply against its command (one token per decode row and per
last prompt chunk, one prompt-logprob span per chunk that asked), so each token is matched to its
request by id here. A token that finishes its request (a stop id, end of sequence, max_tokens) is
held, and published with the finish event only once every rank acknowledged the request's drop,
so a client never sees a request complete whose state a rank still holds. A chunk's full blocks
and state snapshots join the prefix cache here, once its answer is read, never when it is sent. A
request the reply rejects (rank 0 cannot serve one of its values, ``protocol.replies``) ends the
same way, with an error instead: it is dropped, then its stream gets the ErrorEvent naming it and
the reason; nothing its chunk wrote joins the prefix cache.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import structlog

from phalanx.protocol.messages import (
    DecodeDone,
    PrefillDone,
    PromptLogprobs,
    Reply,
    TokenResult,
    UnifiedDone,
)
from phalanx.scheduler.events import (
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    PromptLogprobsEvent,
    TokenEvent,
)
from phalanx.scheduler.planner import Planned, Planner, StepPlan
from phalanx.scheduler.requests import Request
from phalanx.scheduler.step_contract import StepExecutor

log = structlog.get_logger("phalanx.scheduler")

# How a request ends: a finish reason, or the error of a rank's rejection.
Ending = FinishReason | ErrorEvent
# A request a step ended: its slot (-1: ended before it held one), its held last token (None: no
# token of this step is its), how it ends.
Finished = tuple[int, Request, TokenEvent | None, Ending]


def reply_parts(
    reply: Reply,
) -> tuple[Sequence[TokenResult], Sequence[TokenResult], Sequence[PromptLogprobs]]:
    """A step's reply as (decode tokens, first tokens of finished prompts, prompt logprobs)."""
    if isinstance(reply, DecodeDone):
        return reply.results, (), ()
    if isinstance(reply, PrefillDone):
        return (), reply.results, reply.prompt_logprobs
    if isinstance(reply, UnifiedDone):
        return reply.decode, reply.prefill, reply.prompt_logprobs
    raise TypeError(f"{type(reply).__name__} is no reply to a prefill, decode or unified step")


def rejections(reply: Reply, ended: Collection[int]) -> dict[int, ErrorEvent]:
    """The error of each request the reply rejects, but for ``ended`` ones (ending already)."""
    if not isinstance(reply, PrefillDone | DecodeDone | UnifiedDone):
        return {}
    op = {PrefillDone: "prefill", DecodeDone: "decode", UnifiedDone: "unified"}[type(reply)]
    return {
        entry.request_id: ErrorEvent(
            f"request {entry.request_id} rejected by rank 0 during {op}: {entry.reason}", rejected=True
        )
        for entry in reply.rejected
        if entry.request_id not in ended
    }


def token_event(result: TokenResult) -> TokenEvent:
    top = None
    if result.top_ids is not None and result.top_logprobs is not None:
        top = list(zip(result.top_ids, result.top_logprobs, strict=True))
    return TokenEvent(token_id=result.token, logprob=result.logprob, top_logprobs=top)


def prompt_logprob_event(span: PromptLogprobs) -> PromptLogprobsEvent:
    top = None
    if span.top_ids is not None and span.top_logprobs is not None:
        top = [list(zip(i, v, strict=True)) for i, v in zip(span.top_ids, span.top_logprobs, strict=True)]
    return PromptLogprobsEvent(span.start, span.logprobs, span.ranks, top)


class Applier:
    def __init__(self, planner: Planner, executor: StepExecutor, eos_token_ids: frozenset[int]) -> None:
        self.planner = planner
        self.executor = executor
        self.eos_token_ids = eos_token_ids

    def apply(self, plan: StepPlan, reply: Reply, ended: Collection[int] = ()) -> list[Finished]:
        """Take the reply's tokens (those of ``ended`` requests discarded: they finished while
        the step was in flight), decode rows first, then the prompt logprobs, then each finished
        prompt's first token; returns the requests that finished or were rejected, to retire."""
        decoded, prefilled, scored = reply_parts(reply)
        rejected = rejections(reply, ended)
        finished = self._take_decode(plan, decoded, rejected, ended)
        self._publish_prompt_logprobs(scored, ended)
        self._cache_chunks(plan.chunks, reply)
        return finished + self._take_prefill(plan.chunks, prefilled, rejected, ended)

    def take_first_tokens(self, plan: StepPlan, reply: Reply) -> dict[int, tuple[TokenEvent | None, Ending]]:
        """The reply to a prefill whose requests already hold their slots (their first decode
        was sent behind it): publish each first token; returns the requests it finished or
        rejected."""
        _, prefilled, scored = reply_parts(reply)
        rejected = rejections(reply, ())
        self._publish_prompt_logprobs(scored, ())
        tokens = {result.request_id: result for result in prefilled}
        ended: dict[int, tuple[TokenEvent | None, Ending]] = {
            request_id: (None, error) for request_id, error in rejected.items()
        }
        self._cache_chunks(plan.chunks, reply)
        for request, _ in plan.chunks:
            if request.request_id in rejected:
                continue
            event, reason = self._append_token(request, tokens[request.request_id])
            if reason is not None:
                ended[request.request_id] = (event, reason)
        return ended

    def _publish_prompt_logprobs(self, scored: Sequence[PromptLogprobs], ended: Collection[int]) -> None:
        for span in scored:
            request = self.planner.requests.get(span.request_id)
            if request is not None and span.request_id not in ended:  # else nobody reads its stream
                request.emit(prompt_logprob_event(span))

    def _take_decode(
        self,
        plan: StepPlan,
        results: Sequence[TokenResult],
        rejected: dict[int, ErrorEvent],
        ended: Collection[int],
    ) -> list[Finished]:
        tokens = {result.request_id: result for result in results}
        finished: list[Finished] = []
        for row in plan.rows:
            if row.request_id in ended:
                continue
            request = self.planner.requests[row.request_id]
            if row.request_id in rejected:
                finished.append((row.slot, request, None, rejected[row.request_id]))
                continue
            event, reason = self._append_token(request, tokens[row.request_id])
            if reason is not None:
                finished.append((row.slot, request, event, reason))
        return finished

    def _cache_chunks(self, chunks: list[Planned], reply: Reply) -> None:
        """Hand each answered chunk's blocks and snapshots to the prefix cache, but for a rejected
        request's (ended or not: its chunk ran with stand-in values), whose are dropped."""
        every = reply.rejected if isinstance(reply, PrefillDone | DecodeDone | UnifiedDone) else []
        rejected = {entry.request_id for entry in every}
        for request, chunk in chunks:
            if request.request_id in rejected:
                self.planner.chunk_rejected(chunk)
            else:
                self.planner.chunk_answered(request, chunk)

    def _take_prefill(
        self,
        chunks: list[Planned],
        results: Sequence[TokenResult],
        rejected: dict[int, ErrorEvent],
        ended: Collection[int],
    ) -> list[Finished]:
        """Each finished prompt's first token: its request is ready for decode."""
        tokens = {result.request_id: result for result in results}
        finished: list[Finished] = []
        for request, chunk in chunks:
            if request.request_id in ended:
                continue
            if request.request_id in rejected:
                finished.append((-1, request, None, rejected[request.request_id]))
                continue
            if not chunk.last:
                continue
            self.planner.prompt_done(request)
            event, reason = self._append_token(request, tokens[request.request_id])
            if reason is not None:
                finished.append((-1, request, event, reason))
        return finished

    def _append_token(self, request: Request, result: TokenResult) -> tuple[TokenEvent, FinishReason | None]:
        """Add the token to the request's output; publish it unless it finishes the request
        (then it is held for the retirement, with the reason returned)."""
        event = token_event(result)
        request.output.append(event.token_id)
        reason = self._finish_reason(request)
        if reason is None:
            request.emit(event)
        return event, reason

    def _finish_reason(self, request: Request) -> FinishReason | None:
        last = request.output[-1]
        if last in request.params.stop_token_ids:
            return "stop"
        if not request.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if len(request.output) >= request.params.max_tokens:
            return "length"
        return None

    # -- retirement -------------------------------------------------------------------------

    def retire_finished(self, finished: list[Finished]) -> None:
        # Highest slot first: each retirement then moves as few requests as possible.
        for _, request, event, ending in sorted(finished, key=lambda item: item[0], reverse=True):
            self.retire(request, ending, held=() if event is None else (event,))

    def retire_cancelled(self) -> None:
        for request in self.planner.cancelled():
            self.retire(request, "cancelled", held=())

    def retire(self, request: Request, ending: Ending, held: Sequence[Event]) -> None:
        """Drop the request's rank state, free its slot and pages, then publish its ending."""
        drop = self.planner.retirement(request)
        self.executor.collect(self.executor.send(drop))
        self.planner.release(request)
        log.debug("request retired", request_id=request.request_id, ending=ending, move=drop.move)
        for event in held:
            request.emit(event)
        if isinstance(ending, ErrorEvent):
            log.warning("request failed alone", request_id=request.request_id, error=ending.message)
            request.emit(ending)
            return
        request.emit(
            FinishEvent(
                reason=ending, prompt_tokens=len(request.prompt), completion_tokens=len(request.output)
            )
        )
