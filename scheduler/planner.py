"""Planning: which requests hold pages and slots, and what the next step carries.

The planner owns the request bookkeeping (waiting, prefilling, ready, the dense decode slots, the
KV pages and the prefix cache) and turns it into a ``StepPlan``: a decode row for every occupied
slot, in slot order, and prompt chunks that fill what is left of the step's token budget. It sends
nothing; the scheduler sends the plan's command and applies the reply (scheduler.apply).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import msgspec

from phalanx.config.replica import SchedulingConfig
from phalanx.protocol.codec import pack_ids, unpack_ids
from phalanx.protocol.messages import (
    FED_TOKEN,
    NO_TOKEN,
    Capacity,
    Decode,
    DecodeRow,
    DropRequest,
    Expectation,
    Prefill,
    PrefillChunk,
    Unified,
)
from phalanx.scheduler.pages import PagePool, pages_for_tokens
from phalanx.scheduler.prefix_cache import PrefixCache
from phalanx.scheduler.requests import Phase, Request
from phalanx.scheduler.slots import DenseSlots

# A prompt chunk planned for a request.
Planned = tuple[Request, PrefillChunk]


@dataclass(frozen=True)
class StepPlan:
    """One step: decode rows (slot order) and prompt chunks, each chunk beside its request."""

    rows: list[DecodeRow]
    chunks: list[Planned]

    @property
    def empty(self) -> bool:
        return not self.rows and not self.chunks

    def command(self) -> Prefill | Decode | Unified:
        """The command that carries the plan: a Unified when it has both rows and chunks."""
        chunks = [chunk for _, chunk in self.chunks]
        if self.rows and chunks:
            return Unified(chunks, self.rows)
        if self.rows:
            return Decode(self.rows)
        return Prefill(chunks)


class Planner:
    def __init__(
        self,
        capacity: Capacity,
        max_batch_tokens: int,
        snapshot_interval: int = SchedulingConfig.prefix_snapshot_interval,
    ) -> None:
        self.pages = PagePool(capacity.kv_pages, capacity.page_size)
        self.cache = PrefixCache(self.pages, capacity.snapshot_slots, snapshot_interval)
        self.slots = DenseSlots(capacity.max_slots)
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.ready: list[Request] = []
        self.requests: dict[int, Request] = {}

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

    def cancelled(self) -> list[Request]:
        return [request for request in self.requests.values() if request.cancelled]

    def slots_reserved(self) -> int:
        return len(self.slots) + len(self.ready) + len(self.prefilling)

    # -- admission --------------------------------------------------------------------------

    def admit(self) -> None:
        """Waiting requests, in FIFO order, while a decode slot and the pages for their whole
        life (``prompt + max_tokens - 1`` positions) are free or evictable from the prefix cache;
        a request whose prompt starts with a cached prefix starts after it."""
        while self.waiting and self.slots_reserved() < self.slots.capacity:
            request = self.waiting[0]
            needed = pages_for_tokens(request.kv_tokens, self.pages.page_size)
            scored = request.params.prompt_logprobs is not None
            pages = self.cache.admit(request.prefix, request.prompt, needed, scored)
            if pages is None:
                return  # FIFO: later requests wait behind the head rather than starve it
            self.waiting.popleft()
            request.pages = pages
            request.cursor = request.prefix.hit
            request.phase = Phase.PREFILLING
            self.prefilling.append(request)

    def admit_ready(self) -> None:
        """Requests whose prompt is cached take the next dense slots."""
        for request in self.ready:
            self.slots.admit(request.request_id)
            request.phase = Phase.DECODING
        self.ready.clear()

    def prompt_done(self, request: Request) -> None:
        """The request's last prompt chunk was answered: it waits for a decode slot."""
        self.prefilling.remove(request)
        self.ready.append(request)
        request.phase = Phase.READY

    # -- plans ------------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """The next step from scratch: every slot's row with its last token, then prompt chunks."""
        self.admit()
        rows = self._decode_rows(start=0)
        return StepPlan(rows, self.plan_prefill(self.max_batch_tokens - len(rows)))

    def plan_behind(self, current: StepPlan) -> StepPlan | None:
        """The step after ``current``, planned before ``current``'s reply is read: its rows fed
        from it (``FED_TOKEN``), the requests that became ready since joining with their first
        token, new prompt chunks beside them. None when a row of ``current`` ends its request
        by length."""
        continued = [self._continued(row) for row in current.rows]
        rows = [row for row in continued if row is not None]
        if len(rows) < len(continued):
            return None
        rows += self._decode_rows(start=len(rows))
        self.admit()
        return StepPlan(rows, self.plan_prefill(self.max_batch_tokens - len(rows)))

    def feeds_first_decode(self, plan: StepPlan) -> bool:
        """A prefill-only plan whose chunks end every prompt being prefilled, with nothing else
        to do: each request's first decode may follow it unread."""
        if plan.rows or self.waiting or len(plan.chunks) != len(self.prefilling) or self.cancelled():
            return False
        return all(chunk.last and request.params.max_tokens > 1 for request, chunk in plan.chunks)

    def first_decodes(self, plan: StepPlan) -> tuple[StepPlan, StepPlan]:
        """``plan`` with each request taking its decode slot now, its last chunk naming it
        (``feed_slot``, so the ranks keep the token sampled there), and the first decode that
        follows it, ``FED_TOKEN``."""
        chunks, rows = [], []
        for request, chunk in plan.chunks:
            slot = self.slots.admit(request.request_id)
            self.prefilling.remove(request)
            request.phase = Phase.DECODING
            chunks.append((request, msgspec.structs.replace(chunk, feed_slot=slot)))
            rows.append(self._row(slot, request, FED_TOKEN, len(request.prompt)))
        return StepPlan([], chunks), StepPlan(rows, [])

    def plan_prefill(self, budget: int) -> list[Planned]:
        """The next prompt chunks within ``budget`` tokens; each request's cursor moves past its
        chunk here (the chunk is sent in this tick), so a step in flight is never planned twice."""
        planned = []
        for request in self.prefilling:
            if request.cursor == len(request.prompt):
                continue  # every chunk sent: its last one's answer is still in flight
            if budget <= 0:
                break
            end = min(len(request.prompt), request.cursor + budget)
            aligned = end // self.cache.grid * self.cache.grid
            if end < len(request.prompt) and self.cache.enabled and aligned > request.cursor:
                end = aligned  # the next chunk starts where the ranks' saves are free
            budget -= end - request.cursor
            planned.append((request, self._chunk(request, end)))
            request.cursor = end
        return planned

    def _chunk(self, request: Request, end: int) -> PrefillChunk:
        last = end == len(request.prompt)
        saves = []
        if request.params.prompt_logprobs is None:
            saves = self.cache.saves(request.prefix, len(request.prompt), request.cursor, end)
        return PrefillChunk(
            request_id=request.request_id,
            tokens=pack_ids(request.prompt[request.cursor : end]),
            start=request.cursor,
            page_ids=pack_ids(request.pages[: pages_for_tokens(end, self.pages.page_size)]),
            last=last,
            sampling=request.sampling,
            prompt_logprobs=request.params.prompt_logprobs,
            next_token=NO_TOKEN if last else request.prompt[end],
            grammar=request.params.grammar if last else None,
            restore=self.cache.restore_planned(request.prefix),
            save=saves,
        )

    def chunk_answered(self, request: Request, chunk: PrefillChunk) -> None:
        """The ranks ran the chunk: its full blocks and snapshots join the prefix cache."""
        end = chunk.start + len(unpack_ids(chunk.tokens))
        self.cache.answered(request.prefix, request.pages, end, chunk.save)

    def chunk_rejected(self, chunk: PrefillChunk) -> None:
        """The ranks ran the chunk with stand-in values (rank 0 rejected its request): none of it
        joins the prefix cache."""
        self.cache.abandoned(chunk.save)

    def _decode_rows(self, start: int) -> list[DecodeRow]:
        """Rows for the slots from ``start`` on (ready requests take theirs first), each fed the
        request's last token."""
        self.admit_ready()
        owners = self.slots.owners[start:]
        return [
            self._row(slot, request, request.output[-1], request.next_position)
            for slot, request in enumerate((self.requests[rid] for rid in owners), start=start)
        ]

    def _continued(self, row: DecodeRow) -> DecodeRow | None:
        """The row's next step, fed from the ranks, unless its request ends at this one by length."""
        request = self.requests[row.request_id]
        if len(request.output) + 1 >= request.params.max_tokens:
            return None
        return self._row(row.slot, request, FED_TOKEN, row.position + 1)

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

    # -- retirement -------------------------------------------------------------------------

    def retirement(self, request: Request) -> DropRequest:
        """Take the request out of its phase's queue or slot (the last slot moves into the hole);
        returns the drop the ranks must acknowledge before ``release``."""
        expectation, move = Expectation.MUST_EXIST, None
        if request.phase is Phase.WAITING:
            self.waiting.remove(request)
            expectation = Expectation.MUST_BE_ABSENT
        elif request.phase is Phase.PREFILLING:
            self.prefilling.remove(request)
            if request.cursor == request.prefix.hit:  # no chunk sent yet
                expectation = Expectation.MUST_BE_ABSENT
        elif request.phase is Phase.READY:
            self.ready.remove(request)
        elif request.phase is Phase.DECODING:
            move = self.slots.retire(request.request_id)
        else:
            raise RuntimeError(f"request {request.request_id} retired twice")
        return DropRequest(request.request_id, expectation, move)

    def release(self, request: Request) -> None:
        """The ranks dropped the request: its pages are free (or back to the prefix cache) and it
        is no longer open."""
        self.cache.release(request.prefix, request.pages)
        request.pages = []
        request.phase = Phase.DONE
        del self.requests[request.request_id]
