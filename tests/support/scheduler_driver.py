"""Drive a Scheduler against the test double of the ranks (tests/support/fake_ranks.py): build
one, submit requests that record their events, run it until it drains, check nothing leaked."""

from __future__ import annotations

import pytest

from phalanx.protocol.messages import Capacity
from phalanx.scheduler.events import Event, FinishEvent, TokenEvent, is_final
from phalanx.scheduler.requests import GenerationParams, Request
from phalanx.scheduler.scheduler import Scheduler
from tests.support.fake_ranks import FakeRanks


def make(
    kv_pages: int = 64,
    page_size: int = 4,
    max_slots: int = 4,
    max_batch_tokens: int = 16,
    eos=(63,),
    pipeline: bool = False,
    snapshot_slots: int = 0,
    snapshot_interval: int = 1024,
):
    ranks = FakeRanks(Capacity(kv_pages, page_size, max_slots, max_batch_tokens, snapshot_slots))
    return ranks, Scheduler(ranks, eos, pipeline=pipeline, prefix_snapshot_interval=snapshot_interval)


pipelined = pytest.mark.parametrize("pipeline", [False, True], ids=["blocking", "pipelined"])


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        if self.events and is_final(self.events[-1]):
            raise AssertionError("event after the final event")
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if isinstance(e, TokenEvent)]

    @property
    def finish(self) -> FinishEvent | None:
        last = self.events[-1] if self.events else None
        return last if isinstance(last, FinishEvent) else None


_next_id = iter(range(1, 1 << 30))


def submit(sched: Scheduler, prompt: list[int], **params) -> tuple[Request, Sink]:
    sink = Sink()
    request = Request(next(_next_id), prompt, GenerationParams(**params), sink)
    sched.add(request)
    return request, sink


def run(sched: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("scheduler did not drain")


def assert_pools_full(ranks: FakeRanks, sched: Scheduler) -> None:
    """Every request gone: every page free or cached with no reference, every slot free."""
    stats = sched.stats()
    assert (stats.kv_pages_used, stats.slots_used, stats.running, stats.waiting) == (0, 0, 0, 0)
    sched.planner.cache.check_idle()
    assert sched.planner.pages.free + stats.prefix_cache.cached_pages == sched.planner.pages.total
    assert ranks.live_requests() == set()
    assert ranks.slot_map == [None] * len(ranks.slot_map)
