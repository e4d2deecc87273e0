"""The pipeline driver: it owns the steps in flight, so the ranks never wait for the round trip.

A step with decode rows (a Decode, or a Unified when prompt chunks ride along) is sent without
waiting for its reply, and each later tick sends the next step before it reads the previous one.
The next step's rows continue the previous one's ``FED_TOKEN`` (the ranks feed what they
sampled); requests whose prefill was read meanwhile join it with their first token, and new
requests' prompt chunks ride along in a Unified. A row whose request reaches its ``max_tokens``
in the step being read is not continued: that tick reads the step and stops. When a request
stops on EOS (at a decode row or at its prefill), the step already sent behind it is read too
(its token for the finished request is discarded), then the finished requests are retired. A
request that rank 0 rejects (``protocol.replies``) ends the same way: the step behind, which may
carry its row or its next chunk, is read with whatever it answers for the request discarded. A
cancellation waits for the step in flight, at most one step.

A prefill-only step that ends every prompt being prefilled, with nothing else to do, is sent the
same way: its requests take their decode slots at once, each last chunk names its slot
(``feed_slot``), and the first decode follows ``FED_TOKEN`` before the prefill's reply is read. A
request that its prefill's token finishes (EOS), or that the prefill rejects, is retired once that
decode is read.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from phalanx.scheduler.apply import Applier, Ending, Finished
from phalanx.scheduler.events import TokenEvent
from phalanx.scheduler.planner import Planner, StepPlan
from phalanx.scheduler.step_contract import StepExecutor


@dataclass(frozen=True)
class SentStep:
    """A plan sent to the ranks whose reply is not read yet."""

    plan: StepPlan
    handle: Any  # the executor's token for collecting the step


class Pipeline:
    def __init__(self, planner: Planner, applier: Applier, executor: StepExecutor) -> None:
        self.planner = planner
        self.applier = applier
        self.executor = executor
        self.in_flight: SentStep | None = None
        self.prefill_in_flight: SentStep | None = None  # sent just before ``in_flight``

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def takes(self, plan: StepPlan) -> bool:
        """Whether ``plan`` can be left in flight: it has decode rows, or it is a prefill its
        requests' first decodes may follow unread."""
        return bool(plan.rows) or self.planner.feeds_first_decode(plan)

    def start(self, plan: StepPlan) -> int:
        """Send ``plan`` and leave it in flight (a prefill with its first decodes behind it);
        returns the number of steps sent."""
        if plan.rows:
            self.in_flight = self._send(plan)
            return 1
        prefill, first_decodes = self.planner.first_decodes(plan)
        self.prefill_in_flight = self._send(prefill)
        self.in_flight = self._send(first_decodes)
        return 2

    def advance(self) -> int:
        """Send the step after the one in flight (unless a request is being cancelled, or ended
        at its prefill), then read the one in flight; returns the number of steps sent."""
        current = self.in_flight
        if current is None:
            raise RuntimeError("the pipeline advanced with no step in flight")
        ended = self._read_prefill_in_flight()
        following = None
        if not ended and not self.planner.cancelled():
            behind = self.planner.plan_behind(current.plan)
            following = None if behind is None else self._send(behind)
        finished = self._read(current, ended)
        finished += [
            (row.slot, self.planner.requests[row.request_id], *ended[row.request_id])
            for row in current.plan.rows
            if row.request_id in ended
        ]
        self.in_flight = following if following is not None and not finished else None
        if following is not None and finished:
            # The step behind carries the finished requests: read it before they are dropped.
            gone = {request.request_id for _, request, _, _ in finished}
            finished += self._read(following, gone)
        self.applier.retire_finished(finished)
        return 0 if following is None else 1

    def _send(self, plan: StepPlan) -> SentStep:
        return SentStep(plan, self.executor.send(plan.command()))

    def _read(self, step: SentStep, ended: Collection[int]) -> list[Finished]:
        """Collect ``step`` and take its tokens (those of ``ended`` requests discarded)."""
        return self.applier.apply(step.plan, self.executor.collect(step.handle), ended)

    def _read_prefill_in_flight(self) -> dict[int, tuple[TokenEvent | None, Ending]]:
        """Read the prefill sent ahead of the decode in flight, if any: publish each request's
        first token; returns the requests it finished or rejected (to retire once the decode is
        read)."""
        sent, self.prefill_in_flight = self.prefill_in_flight, None
        if sent is None:
            return {}
        return self.applier.take_first_tokens(sent.plan, self.executor.collect(sent.handle))
