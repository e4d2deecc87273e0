"""Continuous batching over the executor: admission, chunked prefill, dense decode, retirement.

One tick (``step``) runs in this order:

1. retire cancelled requests (a request never sent to the ranks is dropped with MustBeAbsent,
   one with rank state with MustExist, one in a decode slot with MustExist plus the compaction);
2. admit waiting requests in FIFO order while a decode slot and the pages for
   ``prompt + max_tokens - 1`` positions are free (reserved for the request's whole life);
3. plan: requests whose prompt is cached take the next dense slots, every slot gets a decode row,
   and prompt chunks fill what is left of the step's token budget;
4. dispatch one Prefill, Decode or Unified command;
5. align the artifacts to the rows, decode results first: finished requests are retired (drop
   with compaction) before their last token and finish event are published, then prompt results.

Pipelined decode (``pipeline=True``): a step with decode rows (a Decode, or a Unified when prompt
chunks ride along) is sent without waiting for its result, and each later tick sends the next
step before it reads the previous one, so the GPU never waits for the round trip. The next step's
rows continue the previous one's ``FED_TOKEN`` (the ranks feed what they sampled); requests whose
prefill was read meanwhile join it with their first token, and new requests' prompt chunks ride
along in a Unified. A row whose request reaches its ``max_tokens`` in the step being read is not
continued: that tick reads the step and stops. When a request stops on EOS (at a decode row or at
its prefill), the step already sent behind it is read too (its token for the finished request is
discarded), then the finished requests are retired. A cancellation waits for the step in flight,
at most one step. A prefill-only step that ends every prompt being prefilled, with nothing else to
do, is sent the same way: its requests take their decode slots at once, each last chunk names its
slot (``feed_slot``), and the first decode follows ``FED_TOKEN`` before the prefill's answer is
read. A request that its prefill's token finishes (EOS) is retired once that decode is read.

The scheduler is single-threaded: the engine calls ``add``, ``cancel`` and ``step`` from its
scheduler thread only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import structlog

from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_TOKEN,
    DecodeRow,
    Expectation,
    PrefillChunk,
    PromptLogprobs,
    TokenResult,
)
from phalanx.protocol.packing import pack_ids
from phalanx.scheduler.events import Event, FinishEvent, FinishReason, TokenEvent
from phalanx.scheduler.pages import PagePool, pages_for_tokens
from phalanx.scheduler.requests import Phase, Request
from phalanx.scheduler.slots import DenseSlots
from phalanx.scheduler.step_contract import (
    PIPELINE_CALLS,
    ArtifactError,
    PipelinedExecutor,
    StepExecutor,
    align_results,
    prompt_logprob_events,
    token_event,
)

log = structlog.get_logger("phalanx.scheduler")


@dataclass
class _InFlight:
    rows: list[DecodeRow]
    handle: Any  # the executor's token for collecting the step
    planned: list[tuple[Request, PrefillChunk]] = field(default_factory=list)  # a Unified's chunks


@dataclass
class _PrefillInFlight:
    """A prefill sent ahead of its requests' first decode (the ``_InFlight`` step behind it)."""

    planned: list[tuple[Request, PrefillChunk]]
    handle: Any


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    slots_used: int
    slots_total: int
    steps: int
    last_step_seconds: float


class Scheduler:
    def __init__(
        self,
        executor: StepExecutor,
        eos_token_ids: Sequence[int],
        *,
        max_batch_tokens: int | None = None,
        pipeline: bool = False,
    ) -> None:
        capacity = executor.capacity
        self.executor = executor
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pages = PagePool(capacity.kv_pages, capacity.page_size)
        self.slots = DenseSlots(capacity.max_slots)
        self.max_batch_tokens = min(capacity.max_batch_tokens, max_batch_tokens or capacity.max_batch_tokens)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.ready: list[Request] = []
        self.requests: dict[int, Request] = {}
        self.steps = 0
        self.last_step_seconds = 0.0
        if pipeline and not all(hasattr(executor, name) for name in PIPELINE_CALLS):
            raise TypeError(
                f"pipelined decode needs {', '.join(PIPELINE_CALLS[:-1])} and {PIPELINE_CALLS[-1]}; "
                f"{type(executor).__name__} has not"
            )
        self.pipeline = pipeline
        self._in_flight: _InFlight | None = None  # pipelined: a decode sent, its result not read
        self._prefill_in_flight: _PrefillInFlight | None = None  # sent just before ``_in_flight``

    # -- intake -----------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        needed = pages_for_tokens(request.kv_tokens, self.pages.page_size)
        if needed > self.pages.total:
            raise ValueError(
                f"request {request.request_id} needs {needed} KV pages for {request.kv_tokens} positions "
                f"but the pool has {self.pages.total}"
            )
        if request.request_id in self.requests or request.request_id == 0:
            raise ValueError(f"request id {request.request_id} is invalid or already in use")
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def cancel(self, request_id: int) -> None:
        """Mark an open request cancelled; it is retired at the start of the next tick."""
        request = self.requests.get(request_id)
        if request is not None:
            request.cancelled = True

    def has_work(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    def open_requests(self) -> list[Request]:
        return list(self.requests.values())

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.prefilling) + len(self.ready) + len(self.slots),
            waiting=len(self.waiting),
            kv_pages_used=self.pages.used,
            kv_pages_total=self.pages.total,
            slots_used=self._slots_reserved(),
            slots_total=self.slots.capacity,
            steps=self.steps,
            last_step_seconds=self.last_step_seconds,
        )

    # -- one tick ---------------------------------------------------------------------------

    def step(self) -> bool:
        """Run one tick; returns whether a step command was dispatched (or read)."""
        if self._in_flight is not None:
            started = time.perf_counter()
            self._continue_pipeline(self._in_flight, self._read_prefill_in_flight())
            self.last_step_seconds = time.perf_counter() - started
            return True
        self._retire_cancelled()
        self._admit()
        rows = self._plan_decode()
        planned = self._plan_prefill(self.max_batch_tokens - len(rows))
        chunks = [chunk for _, chunk in planned]
        if not rows and not chunks:
            if self.requests:
                # Admission never lets the pool refuse a request when nothing runs (add() refuses
                # any request larger than the pool), so open requests with nothing to run is a bug.
                raise RuntimeError(
                    f"scheduler stalled: {len(self.requests)} open requests and nothing to run "
                    f"({len(self.waiting)} waiting, {self.pages.free} of {self.pages.total} pages free)"
                )
            return False
        started = time.perf_counter()
        decoded: Sequence[TokenResult] = ()
        prefilled: Sequence[TokenResult] = ()
        if rows and self.pipeline:
            self._in_flight = self._send(rows, planned)
            self.steps += 1
            self.last_step_seconds = time.perf_counter() - started
            return True
        scored: Sequence[PromptLogprobs] = ()
        if rows and chunks:
            done = self.executor.unified(chunks, rows)
            decoded, prefilled, scored = done.decode, done.prefill, done.prompt_logprobs
        elif rows:
            decoded = self.executor.decode(rows).results
        elif self._feeds_first_decode(planned):
            self._send_prefill_then_decode(planned)
            self.steps += 2
            self.last_step_seconds = time.perf_counter() - started
            return True
        else:
            prefill_done = self.executor.prefill(chunks)
            prefilled, scored = prefill_done.results, prefill_done.prompt_logprobs
        op = "unified" if rows and chunks else "decode" if rows else "prefill"
        self._apply_decode(op, rows, decoded)
        self._publish_prompt_logprobs(op, planned, scored)
        self._apply_prefill(op, planned, prefilled)
        self.steps += 1
        self.last_step_seconds = time.perf_counter() - started
        return True

    # -- pipelined decode -------------------------------------------------------------------

    def _cancelling(self) -> bool:
        return any(request.cancelled for request in self.requests.values())

    def _continued(self, row: DecodeRow) -> DecodeRow | None:
        """The row's next step, fed from the ranks, unless its request ends at this one by length."""
        request = self.requests[row.request_id]
        if len(request.output) + 1 >= request.params.max_tokens:
            return None
        return self._row(row.slot, request, FED_TOKEN, row.position + 1)

    @property
    def _pipelined(self) -> PipelinedExecutor:
        return cast(PipelinedExecutor, self.executor)

    def _send(self, rows: list[DecodeRow], planned: list[tuple[Request, PrefillChunk]]) -> _InFlight:
        """Send a step without reading it: a Decode, or a Unified with prompt chunks."""
        executor = self._pipelined
        if not planned:
            return _InFlight(rows, executor.send_decode(rows))
        return _InFlight(rows, executor.send_unified([chunk for _, chunk in planned], rows), planned)

    def _send_behind(self, current: _InFlight) -> _InFlight | None:
        """The step after ``current``, sent before ``current`` is read: its rows fed from it, the
        requests that became ready since joining with their first token, and new prompt chunks
        beside them. None when a row of ``current`` ends its request by length."""
        continued = [self._continued(row) for row in current.rows]
        rows = [row for row in continued if row is not None]
        if len(rows) < len(continued):
            return None
        running = len(rows)
        self._admit_ready()
        for slot, request_id in enumerate(self.slots.owners[running:], start=running):
            request = self.requests[request_id]
            rows.append(self._row(slot, request, request.output[-1], request.next_position))
        self._admit()
        planned = self._plan_prefill(self.max_batch_tokens - len(rows))
        self.steps += 1
        return self._send(rows, planned)

    def _continue_pipeline(
        self, current: _InFlight, ended: dict[int, tuple[TokenEvent, FinishReason]]
    ) -> None:
        """Send the step after ``current`` (unless a request is being cancelled), then read
        ``current``. ``ended``: requests whose prefill, read just before, finished them
        (``current`` carries them: their tokens in it are discarded, then they are retired)."""
        following = None
        if not ended and not self._cancelling():
            following = self._send_behind(current)
        finished = self._read(current, set(ended))
        finished += [
            (row.slot, self.requests[row.request_id], *ended[row.request_id])
            for row in current.rows
            if row.request_id in ended
        ]
        self._in_flight = following if following is not None and not finished else None
        if following is not None and finished:
            # The step behind carries the finished requests: read it before they are dropped.
            gone = {request.request_id for _, request, _, _ in finished}
            finished += self._read(following, gone)
        self._retire_finished(finished)

    def _read(self, step: _InFlight, ended: set[int]) -> list[tuple[int, Request, TokenEvent, FinishReason]]:
        """Collect ``step`` and take its tokens (those of ``ended`` requests discarded); returns
        the requests that finished (a request finished at its prefill has no slot: -1)."""
        executor = self._pipelined
        if not step.planned:
            return self._take_live_decode(step.rows, executor.collect_decode(step.handle).results, ended)
        done = executor.collect_unified(step.handle)
        finished = self._take_live_decode(step.rows, done.decode, ended, op="unified")
        self._publish_prompt_logprobs("unified", step.planned, done.prompt_logprobs)
        return finished + self._take_prefill("unified", step.planned, done.prefill)

    def _take_live_decode(
        self, rows: list[DecodeRow], results: Sequence[TokenResult], ended: set[int], op: str = "decode"
    ) -> list[tuple[int, Request, TokenEvent, FinishReason]]:
        """``_take_decode`` of the rows whose requests have not ended; the tokens the step sampled
        for ended requests are discarded."""
        if not ended:  # the steady pipeline: every row's token is taken, aligned once
            return self._take_decode(op, rows, results)
        aligned = align_results(op, results, [row.request_id for row in rows])
        live = [row for row in rows if row.request_id not in ended]
        return self._take_decode(op, live, [aligned[row.request_id] for row in live])

    # -- a prefill's first decode, pipelined ------------------------------------------------

    def _feeds_first_decode(self, planned: list[tuple[Request, PrefillChunk]]) -> bool:
        """A pipelined prefill-only step whose chunks end every prompt being prefilled, with
        nothing else to do: each request's first decode may follow it unread."""
        if not self.pipeline or self.waiting or len(planned) != len(self.prefilling):
            return False
        if any(request.cancelled for request in self.requests.values()):
            return False
        return all(chunk.last and request.params.max_tokens > 1 for request, chunk in planned)

    def _send_prefill_then_decode(self, planned: list[tuple[Request, PrefillChunk]]) -> None:
        """Each request takes its decode slot now; its last chunk names it (``feed_slot``), so
        the ranks keep the token sampled there, and its first decode row is sent behind the
        prefill, ``FED_TOKEN``, before the prefill's answer is read."""
        chunks, rows = [], []
        for request, chunk in planned:
            slot = self.slots.admit(request.request_id)
            self.prefilling.remove(request)
            request.phase = Phase.DECODING
            chunks.append(msgspec.structs.replace(chunk, feed_slot=slot))
            rows.append(self._row(slot, request, FED_TOKEN, len(request.prompt)))
        executor = self._pipelined
        self._prefill_in_flight = _PrefillInFlight(planned, executor.send_prefill(chunks))
        self._in_flight = _InFlight(rows, executor.send_decode(rows))

    def _read_prefill_in_flight(self) -> dict[int, tuple[TokenEvent, FinishReason]]:
        """Read the prefill sent ahead of the decode in flight, if any: publish each request's
        first token; returns the requests it finished (to retire once the decode is read)."""
        sent, self._prefill_in_flight = self._prefill_in_flight, None
        if sent is None:
            return {}
        done = self._pipelined.collect_prefill(sent.handle)
        self._publish_prompt_logprobs("prefill", sent.planned, done.prompt_logprobs)
        aligned = align_results("prefill", done.results, [chunk.request_id for _, chunk in sent.planned])
        ended: dict[int, tuple[TokenEvent, FinishReason]] = {}
        for request, _ in sent.planned:
            event, reason = self._append_token(request, aligned[request.request_id])
            if reason is not None:
                ended[request.request_id] = (event, reason)
        return ended

    def _slots_reserved(self) -> int:
        return len(self.slots) + len(self.ready) + len(self.prefilling)

    def _retire_cancelled(self) -> None:
        for request in [r for r in self.requests.values() if r.cancelled]:
            self._retire(request, "cancelled", held=())

    def _admit(self) -> None:
        while self.waiting and self._slots_reserved() < self.slots.capacity:
            request = self.waiting[0]
            needed = pages_for_tokens(request.kv_tokens, self.pages.page_size)
            if not self.pages.can_allocate(needed):
                return  # FIFO: later requests wait behind the head rather than starve it
            self.waiting.popleft()
            request.pages = self.pages.allocate(needed)
            request.phase = Phase.PREFILLING
            self.prefilling.append(request)

    def _admit_ready(self) -> None:
        """Requests whose prompt is cached take the next dense slots."""
        for request in self.ready:
            self.slots.admit(request.request_id)
            request.phase = Phase.DECODING
        self.ready.clear()

    def _row(self, slot: int, request: Request, token: int, position: int) -> DecodeRow:
        page_ids = request.pages[: pages_for_tokens(position + 1, self.pages.page_size)]
        return DecodeRow(
            request_id=request.request_id,
            slot=slot,
            token=token,
            position=position,
            page_ids=pack_ids(page_ids),
            sampling=request.sampling,
        )

    def _plan_decode(self) -> list[DecodeRow]:
        self._admit_ready()
        return [
            self._row(slot, request, request.output[-1], request.next_position)
            for slot, request in ((slot, self.requests[rid]) for slot, rid in enumerate(self.slots.owners))
        ]

    def _plan_prefill(self, budget: int) -> list[tuple[Request, PrefillChunk]]:
        """The next prompt chunks within ``budget`` tokens; each request's cursor moves past its
        chunk here (the chunk is sent in this tick), so a step in flight is never planned twice."""
        planned = []
        for request in self.prefilling:
            if request.cursor == len(request.prompt):
                continue  # every chunk sent: its last one's answer is still in flight
            if budget <= 0:
                break
            end = min(len(request.prompt), request.cursor + budget)
            budget -= end - request.cursor
            chunk = PrefillChunk(
                request_id=request.request_id,
                tokens=pack_ids(request.prompt[request.cursor : end]),
                start=request.cursor,
                page_ids=pack_ids(request.pages[: pages_for_tokens(end, self.pages.page_size)]),
                last=end == len(request.prompt),
                sampling=request.sampling,
                prompt_logprobs=request.params.prompt_logprobs,
                next_token=request.prompt[end] if end < len(request.prompt) else NO_TOKEN,
                grammar=request.params.grammar if end == len(request.prompt) else None,
            )
            planned.append((request, chunk))
            request.cursor = end
        return planned

    # -- results ----------------------------------------------------------------------------

    def _finish_reason(self, request: Request) -> FinishReason | None:
        last = request.output[-1]
        if last in request.params.stop_token_ids:
            return "stop"
        if not request.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if len(request.output) >= request.params.max_tokens:
            return "length"
        return None

    def _apply_decode(self, op: str, rows: list[DecodeRow], results: Sequence[TokenResult]) -> None:
        if not rows:
            if results:
                raise ArtifactError(
                    f"invalid {op} artifact set: {len(results)} decode results for no decode rows"
                )
            return
        self._retire_finished(self._take_decode(op, rows, results))

    def _take_decode(
        self, op: str, rows: list[DecodeRow], results: Sequence[TokenResult]
    ) -> list[tuple[int, Request, TokenEvent, FinishReason]]:
        """Append each row's token to its request and publish it; returns the requests that
        finished with it (slot, request, last token, reason), to retire."""
        aligned = align_results(op, results, [row.request_id for row in rows])
        finished: list[tuple[int, Request, TokenEvent, FinishReason]] = []
        for row in rows:
            request = self.requests[row.request_id]
            event, reason = self._append_token(request, aligned[row.request_id])
            if reason is not None:
                finished.append((row.slot, request, event, reason))
        return finished

    def _append_token(self, request: Request, result: TokenResult) -> tuple[TokenEvent, FinishReason | None]:
        """Add ``result``'s token to the request's output; publish it unless it finishes the
        request (then it is held for the retirement, with the reason returned)."""
        event = token_event(result)
        request.output.append(event.token_id)
        reason = self._finish_reason(request)
        if reason is None:
            request.emit(event)
        return event, reason

    def _retire_finished(self, finished: list[tuple[int, Request, TokenEvent, FinishReason]]) -> None:
        # Highest slot first: each retirement then moves as few requests as possible.
        for _, request, event, reason in sorted(finished, key=lambda item: item[0], reverse=True):
            self._retire(request, reason, held=(event,))

    def _apply_prefill(
        self, op: str, planned: list[tuple[Request, PrefillChunk]], results: Sequence[TokenResult]
    ) -> None:
        self._retire_finished(self._take_prefill(op, planned, results))

    def _publish_prompt_logprobs(
        self, op: str, planned: list[tuple[Request, PrefillChunk]], scored: Sequence[PromptLogprobs]
    ) -> None:
        for request_id, event in prompt_logprob_events(op, [chunk for _, chunk in planned], scored):
            if request_id in self.requests:  # else retired meanwhile: nobody reads its stream
                self.requests[request_id].emit(event)

    def _take_prefill(
        self, op: str, planned: list[tuple[Request, PrefillChunk]], results: Sequence[TokenResult]
    ) -> list[tuple[int, Request, TokenEvent, FinishReason]]:
        """Each finished prompt's first token: its request is ready for decode; returns those it
        finished (no slot: -1), to retire."""
        aligned = align_results(op, results, [chunk.request_id for _, chunk in planned if chunk.last])
        finished: list[tuple[int, Request, TokenEvent, FinishReason]] = []
        for request, chunk in planned:
            if not chunk.last:
                continue
            self.prefilling.remove(request)
            self.ready.append(request)
            request.phase = Phase.READY
            event, reason = self._append_token(request, aligned[request.request_id])
            if reason is not None:
                finished.append((-1, request, event, reason))
        return finished

    # -- retirement -------------------------------------------------------------------------

    def _retire(self, request: Request, reason: FinishReason, held: Sequence[Event]) -> None:
        """Drop the request's rank state, free its slot and pages, then publish its ending.

        The last token and the finish event are held until every rank acknowledged the drop, so
        a client never sees a request complete whose state a rank still holds.
        """
        expectation, move = Expectation.MUST_EXIST, None
        if request.phase is Phase.WAITING:
            self.waiting.remove(request)
            expectation = Expectation.MUST_BE_ABSENT
        elif request.phase is Phase.PREFILLING:
            self.prefilling.remove(request)
            if request.cursor == 0:
                expectation = Expectation.MUST_BE_ABSENT
        elif request.phase is Phase.READY:
            self.ready.remove(request)
        elif request.phase is Phase.DECODING:
            move = self.slots.retire(request.request_id)
        else:
            raise RuntimeError(f"request {request.request_id} retired twice")
        self.executor.drop(request.request_id, expectation, move)
        self.pages.release(request.pages)
        request.pages = []
        request.phase = Phase.DONE
        del self.requests[request.request_id]
        log.debug("request retired", request_id=request.request_id, reason=reason, move=move)
        for event in held:
            request.emit(event)
        request.emit(
            FinishEvent(
                reason=reason, prompt_tokens=len(request.prompt), completion_tokens=len(request.output)
            )
        )
