"""Continuous batching over the executor: one tick plans a step, sends it and applies its reply.

One tick (``step``) runs in this order:

1. retire cancelled requests (a request never sent to the ranks is dropped with MustBeAbsent,
   one with rank state with MustExist, one in a decode slot with MustExist plus the compaction);
2. plan (scheduler.planner): admit waiting requests in FIFO order while a decode slot and the
   pages for ``prompt + max_tokens - 1`` positions are free (reserved for the request's whole
   life; a cached prompt prefix is restored, not prefilled: scheduler.prefix_cache); requests
   whose prompt is cached take the next dense slots, every slot gets a decode row, and prompt
   chunks fill what is left of the step's token budget;
3. send the plan's Prefill, Decode or Unified command;
4. apply the reply (scheduler.apply), decode tokens first: the requests it finished are retired
   (drop with compaction) before their last token and finish event are published.

Pipelined decode (``pipeline=True``, scheduler.pipeline): a plan with decode rows is left in
flight, and while a step is in flight a tick sends the next one before it reads the last.

The scheduler is single-threaded: the engine calls ``add``, ``cancel`` and ``step`` from its
scheduler thread only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from phalanx.config.replica import SchedulingConfig
from phalanx.scheduler.apply import Applier
from phalanx.scheduler.pipeline import Pipeline
from phalanx.scheduler.planner import Planner
from phalanx.scheduler.prefix_cache import PrefixCacheStats
from phalanx.scheduler.requests import Request
from phalanx.scheduler.step_contract import StepExecutor


@dataclass(frozen=True)
class SchedulerStats:
    running: int
    waiting: int
    kv_pages_used: int  # held by requests (their own, and cached ones they reference)
    kv_pages_total: int
    slots_used: int
    slots_total: int
    steps: int
    last_step_seconds: float
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class Scheduler:
    def __init__(
        self,
        executor: StepExecutor,
        eos_token_ids: Sequence[int],
        *,
        max_batch_tokens: int | None = None,
        pipeline: bool = False,
        prefix_snapshot_interval: int = SchedulingConfig.prefix_snapshot_interval,
    ) -> None:
        capacity = executor.capacity
        self.executor = executor
        budget = min(capacity.max_batch_tokens, max_batch_tokens or capacity.max_batch_tokens)
        self.planner = Planner(capacity, budget, prefix_snapshot_interval)
        self.applier = Applier(self.planner, executor, frozenset(eos_token_ids))
        self.pipeline = Pipeline(self.planner, self.applier, executor) if pipeline else None
        self.steps = 0
        self.last_step_seconds = 0.0

    def add(self, request: Request) -> None:
        self.planner.add(request)

    def cancel(self, request_id: int) -> None:
        """Mark an open request cancelled; it is retired at the start of the next tick."""
        self.planner.cancel(request_id)

    def has_work(self) -> bool:
        return bool(self.planner.requests) or (self.pipeline is not None and self.pipeline.busy)

    def stats(self) -> SchedulerStats:
        planner = self.planner
        return SchedulerStats(
            running=len(planner.prefilling) + len(planner.ready) + len(planner.slots),
            waiting=len(planner.waiting),
            kv_pages_used=planner.pages.used + planner.cache.referenced_pages,
            kv_pages_total=planner.pages.total,
            slots_used=planner.slots_reserved(),
            slots_total=planner.slots.capacity,
            steps=self.steps,
            last_step_seconds=self.last_step_seconds,
            prefix_cache=planner.cache.stats(),
        )

    def step(self) -> bool:
        """Run one tick; returns whether a step command was sent (or read)."""
        started = time.perf_counter()
        if self.pipeline is not None and self.pipeline.busy:
            self.steps += self.pipeline.advance()
        elif not self._run_next():
            return False
        self.last_step_seconds = time.perf_counter() - started
        return True

    def _run_next(self) -> bool:
        """Plan the next step and send it: left in flight when pipelined, else read at once."""
        self.applier.retire_cancelled()
        plan = self.planner.plan()
        if plan.empty:
            if self.planner.requests:
                # Admission never lets the pool refuse a request when nothing runs (add() refuses
                # any request larger than the pool), so open requests with nothing to run is a bug.
                raise RuntimeError(
                    f"scheduler stalled: {len(self.planner.requests)} open requests and nothing to run "
                    f"({len(self.planner.waiting)} waiting, {self.planner.pages.free} of "
                    f"{self.planner.pages.total} pages free)"
                )
            return False
        if self.pipeline is not None and self.pipeline.takes(plan):
            self.steps += self.pipeline.start(plan)
            return True
        reply = self.executor.collect(self.executor.send(plan.command()))
        self.applier.retire_finished(self.applier.apply(plan, reply))
        self.steps += 1
        return True
