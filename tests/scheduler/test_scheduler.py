"""Scheduler logic against a test double of the ranks (tests/support/fake_ranks.py): admission, chunked
prefill, unified steps, dense slots with compaction, cancellation in every phase, completion held
until the drop is acknowledged, pipelined decode. The real-runtime versions of these live in
tests/engine/test_engine*.py."""

from __future__ import annotations

import random

import pytest

from phalanx.protocol.messages import FED_TOKEN, NO_FEED, Capacity, Expectation, SlotMove
from phalanx.scheduler.events import Event, FinishEvent, TokenEvent
from phalanx.scheduler.pages import PagePool
from phalanx.scheduler.requests import GenerationParams, Phase, Request
from phalanx.scheduler.scheduler import Scheduler
from phalanx.scheduler.slots import DenseSlots
from tests.support.fake_ranks import FakeRanks, RankStateError


def make(
    kv_pages: int = 64,
    page_size: int = 4,
    max_slots: int = 4,
    max_batch_tokens: int = 16,
    eos=(63,),
    pipeline: bool = False,
):
    ranks = FakeRanks(Capacity(kv_pages, page_size, max_slots, max_batch_tokens))
    return ranks, Scheduler(ranks, eos, pipeline=pipeline)


pipelined = pytest.mark.parametrize("pipeline", [False, True], ids=["blocking", "pipelined"])


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        if self.events and isinstance(self.events[-1], FinishEvent):
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
    stats = sched.stats()
    assert (stats.kv_pages_used, stats.slots_used, stats.running, stats.waiting) == (0, 0, 0, 0)
    assert sched.planner.pages.free == sched.planner.pages.total
    assert ranks.live_requests() == set()
    assert ranks.slot_map == [None] * len(ranks.slot_map)


def random_workload(rng: random.Random, count: int) -> list[tuple[list[int], dict]]:
    work = []
    for index in range(count):
        prompt = [rng.randrange(60) for _ in range(rng.randint(1, 23))]
        params = {"max_tokens": rng.randint(1, 9), "ignore_eos": True}
        if index % 2:
            params |= {"temperature": 0.8, "seed": rng.randrange(1000)}
        work.append((prompt, params))
    return work


@pipelined
def test_batched_requests_match_each_alone(pipeline: bool) -> None:
    work = random_workload(random.Random(0), 16)
    alone = []
    for prompt, params in work:
        ranks, sched = make()
        _, sink = submit(sched, prompt, **params)
        run(sched)
        alone.append(sink.tokens)
    ranks, sched = make(kv_pages=24, max_slots=4, max_batch_tokens=8, pipeline=pipeline)
    sinks = [submit(sched, prompt, **params)[1] for prompt, params in work]
    run(sched)
    assert [sink.tokens for sink in sinks] == alone
    assert all(sink.finish.reason == "length" for sink in sinks)
    assert [len(t) for t in alone] == [p["max_tokens"] for _, p in work]
    kinds = {kind for kind, _ in ranks.commands}
    assert {"prefill", "decode", "unified", "drop"} <= kinds
    assert_pools_full(ranks, sched)


def test_long_prompt_is_prefilled_in_chunks_under_the_token_budget() -> None:
    ranks, sched = make(max_batch_tokens=5)
    _, sink = submit(sched, list(range(13)), max_tokens=2, ignore_eos=True)
    run(sched)
    chunks = [c for kind, cs in ranks.commands if kind == "prefill" for c in cs]
    assert [(c.start, len(c.tokens) // 4, c.last) for c in chunks] == [
        (0, 5, False),
        (5, 5, False),
        (10, 3, True),
    ]
    assert len(sink.tokens) == 2 and sink.finish.reason == "length"


def test_decode_rows_share_the_step_budget_with_prefill() -> None:
    ranks, sched = make(max_batch_tokens=6)
    submit(sched, [1, 2], max_tokens=5, ignore_eos=True)
    sched.step()  # prefill of the first request
    submit(sched, list(range(20)), max_tokens=1, ignore_eos=True)
    sched.step()
    kind, (chunks, rows) = ranks.commands[-1]
    assert kind == "unified" and len(rows) == 1 and len(chunks[0].tokens) // 4 == 5


def test_retirement_compacts_the_last_slot_into_the_hole() -> None:
    ranks, sched = make()
    submit(sched, [1], max_tokens=8, ignore_eos=True)
    short, _ = submit(sched, [2], max_tokens=2, ignore_eos=True)
    last, _ = submit(sched, [3], max_tokens=8, ignore_eos=True)
    sched.step()  # prefill of all three: one token each
    sched.step()  # first decode: the short request reaches max_tokens
    drops = [args for kind, args in ranks.commands if kind == "drop"]
    assert drops == [(short.request_id, Expectation.MUST_EXIST, SlotMove(last.request_id, 2, 1))]
    assert sched.planner.slots.owners[1] == last.request_id
    run(sched)
    assert_pools_full(ranks, sched)


@pipelined
def test_several_retirements_in_one_step(pipeline: bool) -> None:
    ranks, sched = make(max_slots=5, pipeline=pipeline)
    requests = [submit(sched, [i], max_tokens=m, ignore_eos=True) for i, m in enumerate([3, 2, 5, 2, 2])]
    run(sched)
    assert [sink.finish.completion_tokens for _, sink in requests] == [3, 2, 5, 2, 2]
    assert_pools_full(ranks, sched)


@pipelined
def test_eos_stops_unless_ignored(pipeline: bool) -> None:
    ranks, sched = make()
    _, probe = submit(sched, [5, 6, 7], max_tokens=4, ignore_eos=True)
    run(sched)
    eos = probe.tokens[1]
    ranks, sched = make(eos=(eos,), pipeline=pipeline)
    _, stopped = submit(sched, [5, 6, 7], max_tokens=4)
    _, ignored = submit(sched, [5, 6, 7], max_tokens=4, ignore_eos=True)
    run(sched)
    assert stopped.tokens == probe.tokens[:2] and stopped.finish.reason == "stop"
    assert ignored.tokens == probe.tokens and ignored.finish.reason == "length"
    assert stopped.finish.completion_tokens == 2


@pipelined
def test_stop_token_ids_stop_even_when_eos_is_ignored(pipeline: bool) -> None:
    ranks, sched = make()
    _, probe = submit(sched, [5, 6, 7], max_tokens=4, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=pipeline)
    _, stopped = submit(sched, [5, 6, 7], max_tokens=4, ignore_eos=True, stop_token_ids=(probe.tokens[2],))
    run(sched)
    assert stopped.tokens == probe.tokens[:3] and stopped.finish.reason == "stop"


def test_min_tokens_bans_the_ending_ids_up_to_the_last_required_position() -> None:
    params = GenerationParams(max_tokens=8, min_tokens=3, stop_token_ids=(9, 4))
    sampling = params.sampling(5, eos_token_ids=(63,))
    assert (sampling.banned_ids, sampling.banned_until) == ([4, 9, 63], 8)
    ignoring = GenerationParams(max_tokens=8, min_tokens=3, ignore_eos=True).sampling(5, (63,))
    assert (ignoring.banned_ids, ignoring.banned_until) == (None, 0)
    assert GenerationParams(max_tokens=8).sampling(5, (63,)).banned_ids is None
    with pytest.raises(ValueError, match=r"min_tokens must be an integer in \[0, max_tokens\], got 9"):
        GenerationParams(max_tokens=8, min_tokens=9).validate(64)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 64 is outside the vocabulary \[0, 64\)"):
        GenerationParams(stop_token_ids=(64,)).validate(64)
    with pytest.raises(ValueError, match=r"logit_bias: token id -1 is outside the vocabulary"):
        GenerationParams(logit_bias={-1: 2.0}).validate(64)


def test_request_finishing_at_prefill_is_dropped_from_staging() -> None:
    ranks, sched = make()
    request, sink = submit(sched, [1, 2, 3], max_tokens=1)
    run(sched)
    assert ranks.commands[-1] == ("drop", (request.request_id, Expectation.MUST_EXIST, None))
    assert len(sink.tokens) == 1 and sink.finish.reason == "length"
    assert_pools_full(ranks, sched)


@pytest.mark.parametrize("phase", ["waiting", "admitted", "prefilling", "ready", "decoding"])
def test_cancellation_in_every_phase_leaks_nothing(phase: str) -> None:
    ranks, sched = make(max_slots=1, max_batch_tokens=4)
    blocker, _ = submit(sched, [9], max_tokens=3, ignore_eos=True)
    request, sink = submit(sched, list(range(10)), max_tokens=5, ignore_eos=True)
    expectation, steps = Expectation.MUST_EXIST, 0
    if phase == "waiting":
        expectation = Expectation.MUST_BE_ABSENT
    elif phase == "admitted":
        # Cancel the blocker so the request is admitted, with the budget spent on nothing yet.
        sched.cancel(blocker.request_id)
        sched.applier.retire_cancelled()
        sched.planner.admit()
        expectation = Expectation.MUST_BE_ABSENT
    else:
        steps = {"prefilling": 4, "ready": 6, "decoding": 7}[phase]
    for _ in range(steps):
        sched.step()
    expected_phase = {"waiting": Phase.WAITING, "admitted": Phase.PREFILLING, "prefilling": Phase.PREFILLING}
    expected_phase |= {"ready": Phase.READY, "decoding": Phase.DECODING}
    assert request.phase is expected_phase[phase]
    sched.cancel(request.request_id)
    sched.cancel(request.request_id)  # idempotent
    run(sched)
    drop = next(args for kind, args in ranks.commands if kind == "drop" and args[0] == request.request_id)
    assert drop[1] is expectation
    assert sink.finish.reason == "cancelled"
    assert sum(isinstance(e, FinishEvent) for e in sink.events) == 1
    assert_pools_full(ranks, sched)
    sched.cancel(request.request_id)  # after the end: a no-op
    assert not sched.has_work()


def test_full_pool_queues_instead_of_failing() -> None:
    ranks, sched = make(kv_pages=4, page_size=4)
    first, first_sink = submit(sched, list(range(10)), max_tokens=4, ignore_eos=True)  # 13 positions: 4 pages
    second, second_sink = submit(sched, [1, 2], max_tokens=2, ignore_eos=True)
    sched.step()
    assert second.phase is Phase.WAITING and sched.stats().waiting == 1 and sched.stats().kv_pages_used == 4
    run(sched)
    assert first_sink.finish.reason == second_sink.finish.reason == "length"
    assert_pools_full(ranks, sched)


def test_request_larger_than_the_pool_is_refused() -> None:
    _, sched = make(kv_pages=2, page_size=4)
    with pytest.raises(ValueError, match=r"needs 3 KV pages for 9 positions but the pool has 2"):
        submit(sched, list(range(8)), max_tokens=2)
    assert not sched.has_work()


def test_completion_is_held_until_the_drop_is_acknowledged() -> None:
    ranks, sched = make()
    request, sink = submit(sched, [1, 2], max_tokens=2, ignore_eos=True)
    sched.step()
    ranks.fail_on_drop_of = request.request_id
    with pytest.raises(RankStateError, match="injected drop failure"):
        sched.step()
    assert len(sink.tokens) == 1 and sink.finish is None
    assert sched.planner.requests[request.request_id] is request


@pipelined
def test_soak_with_random_cancellations_ends_with_full_pools(pipeline: bool) -> None:
    rng = random.Random(7)
    ranks, sched = make(kv_pages=40, max_slots=6, max_batch_tokens=12, eos=(3, 17), pipeline=pipeline)
    sinks: list[tuple[Request, Sink]] = []
    for prompt, params in random_workload(rng, 500):
        params["ignore_eos"] = rng.random() < 0.5
        sinks.append(submit(sched, prompt, **params))
        if rng.random() < 0.3:
            sched.cancel(rng.choice(sinks)[0].request_id)
        if rng.random() < 0.5:
            sched.step()
    run(sched)
    assert_pools_full(ranks, sched)
    reasons = [sink.finish.reason for _, sink in sinks]
    assert set(reasons) == {"stop", "length", "cancelled"}
    for request, sink in sinks:
        assert sum(isinstance(e, FinishEvent) for e in sink.events) == 1
        assert len(sink.tokens) == sink.finish.completion_tokens <= request.params.max_tokens


def test_pipelined_decode_sends_each_step_before_reading_the_last() -> None:
    _, sched = make()
    _, alone = submit(sched, [4, 5], max_tokens=12, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [4, 5], max_tokens=12, ignore_eos=True)
    run(sched)
    assert sink.tokens == alone.tokens and sink.finish.reason == "length"
    decodes = [rows for kind, rows in ranks.commands if kind == "decode"]
    # Every decode is sent before the step ahead of it is read, so it feeds what the ranks
    # sampled: the first one the prefill's token, which its chunk kept for slot 0. The last step
    # is never continued.
    assert [kind for kind, _ in ranks.commands[:2]] == ["prefill", "decode"]
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [0]
    assert [row.token == FED_TOKEN for (row,) in decodes] == [True] * 11
    assert [row.position for (row,) in decodes] == list(range(2, 13))
    assert ranks.most_in_flight == 2
    assert ranks.commands[-1] == ("drop", (request.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


def test_pipelined_eos_reads_the_step_behind_and_discards_its_token() -> None:
    _, sched = make()
    _, probe = submit(sched, [8, 9], max_tokens=10, ignore_eos=True)
    _, other = submit(sched, [1], max_tokens=10, ignore_eos=True)
    run(sched)
    eos = probe.tokens[4]
    ranks, sched = make(eos=(eos,), pipeline=True)
    stopped, stopped_sink = submit(sched, [8, 9], max_tokens=10)
    _, going = submit(sched, [1], max_tokens=10, ignore_eos=True)
    run(sched)
    assert stopped_sink.tokens == probe.tokens[:5] and stopped_sink.finish.reason == "stop"
    assert going.tokens == other.tokens and going.finish.reason == "length"
    # The step after the EOS still carried the stopped request; then it was dropped.
    decodes = [rows for kind, rows in ranks.commands if kind == "decode"]
    fed_stopped = [row.position for rows in decodes for row in rows if row.request_id == stopped.request_id]
    assert fed_stopped == [2, 3, 4, 5, 6]  # positions 2..5 made its tokens 2..5; position 6 was discarded
    assert_pools_full(ranks, sched)


def test_the_first_decodes_follow_their_prefill_unread_fed_from_their_slots() -> None:
    _, sched = make()
    _, first_alone = submit(sched, [4, 5], max_tokens=6, ignore_eos=True)
    _, second_alone = submit(sched, [7], max_tokens=6, ignore_eos=True)
    run(sched)
    ranks, sched = make(pipeline=True)
    _, first = submit(sched, [4, 5], max_tokens=6, ignore_eos=True)
    _, second = submit(sched, [7], max_tokens=6, ignore_eos=True)
    sched.step()  # the prefill, then the first decode behind it: nothing read yet
    kinds = [kind for kind, _ in ranks.commands]
    assert kinds == ["prefill", "decode"] and ranks.most_in_flight == 2
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [0, 1]
    assert [(row.slot, row.token) for row in ranks.commands[1][1]] == [(0, FED_TOKEN), (1, FED_TOKEN)]
    assert first.tokens == [] and second.tokens == []
    run(sched)
    assert first.tokens == first_alone.tokens and second.tokens == second_alone.tokens
    assert_pools_full(ranks, sched)


def test_a_prefill_token_that_stops_its_request_discards_the_decode_behind_it() -> None:
    _, sched = make()
    _, probe = submit(sched, [8, 9], max_tokens=10, ignore_eos=True)
    run(sched)
    ranks, sched = make(eos=(probe.tokens[0],), pipeline=True)
    stopped, sink = submit(sched, [8, 9], max_tokens=10)
    run(sched)
    assert sink.tokens == probe.tokens[:1] and sink.finish.reason == "stop"
    assert [kind for kind, _ in ranks.commands] == ["prefill", "decode", "drop"]
    # The decode sent behind the prefill ran (the request holds slot 0 on the ranks); its token
    # is dropped with the request.
    assert ranks.commands[-1] == ("drop", (stopped.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


def test_a_cancellation_after_a_pipelined_prefill_reads_both_steps_first() -> None:
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [2, 3], max_tokens=8, ignore_eos=True)
    sched.step()  # prefill + first decode in flight
    sched.cancel(request.request_id)
    run(sched)
    assert len(sink.tokens) == 2 and sink.finish.reason == "cancelled"
    assert [kind for kind, _ in ranks.commands] == ["prefill", "decode", "drop"]
    assert_pools_full(ranks, sched)


@pytest.mark.parametrize(
    "case", ["one token", "a waiting request", "a prompt in chunks"], ids=lambda case: case.replace(" ", "_")
)
def test_a_prefill_is_read_before_any_decode_when_its_requests_cannot_all_decode_next(case: str) -> None:
    ranks, sched = make(pipeline=True, max_slots=1 if case == "a waiting request" else 4)
    prompt = list(range(1, 21)) if case == "a prompt in chunks" else [3, 4]  # 20 tokens: 16, then 4
    submit(sched, prompt, max_tokens=1 if case == "one token" else 5, ignore_eos=True)
    if case == "a waiting request":
        submit(sched, [5], max_tokens=2, ignore_eos=True)  # no slot is left for it
    sched.step()  # the prefill, read at once: no decode behind it
    assert [kind for kind, _ in ranks.commands] == (
        ["prefill", "drop"] if case == "one token" else ["prefill"]
    )
    assert [chunk.feed_slot for chunk in ranks.commands[0][1]] == [NO_FEED]
    run(sched)
    if case != "one token":  # a prompt's last chunk, or the waiting request once alone, feeds
        last = [chunks for kind, chunks in ranks.commands if kind == "prefill"][-1]
        assert [chunk.feed_slot for chunk in last] == [0]
    assert_pools_full(ranks, sched)


def _pipelining(ticks: int) -> tuple[FakeRanks, Scheduler, Request, Sink]:
    """A pipelined scheduler ``ticks`` ticks into one request of 20 tokens."""
    ranks, sched = make(pipeline=True)
    request, sink = submit(sched, [1, 2], max_tokens=20, ignore_eos=True)
    for _ in range(ticks):
        sched.step()
    assert ranks.commands[-1][0] == "decode" and ranks.most_in_flight == 2
    return ranks, sched, request, sink


def test_a_new_request_rides_along_the_pipeline_in_a_unified_step_then_joins_it() -> None:
    """A request that arrives while the pipeline runs does not stop it: its prompt goes out in a
    Unified sent behind the step in flight, beside that step's fed rows, and once that Unified is
    read its request joins the next step with its first token (the others still fed)."""
    ranks, sched = make()
    _, first_alone = submit(sched, [1, 2], max_tokens=20, ignore_eos=True)
    _, second_alone = submit(sched, [3], max_tokens=3, ignore_eos=True)
    run(sched)
    ranks, sched, first_request, first = _pipelining(4)
    second_request, second = submit(sched, [3], max_tokens=3, ignore_eos=True)
    sent = len(ranks.commands)
    sched.step()  # the Unified goes out before the step in flight is read
    kind, (chunks, rows) = ranks.commands[sent]
    assert kind == "unified" and [chunk.request_id for chunk in chunks] == [second_request.request_id]
    assert [(row.slot, row.token) for row in rows] == [(0, FED_TOKEN)]
    assert ranks.most_in_flight == 2
    sched.step()  # the decode behind the Unified: the first request fed, the new one not yet ready
    kind, rows = ranks.commands[sent + 1]
    assert kind == "decode" and [(row.slot, row.token) for row in rows] == [(0, FED_TOKEN)]
    sched.step()  # the Unified was read: the new request joins with its first token
    kind, rows = ranks.commands[sent + 2]
    assert kind == "decode" and [row.request_id for row in rows] == [
        first_request.request_id,
        second_request.request_id,
    ]
    assert rows[0].token == FED_TOKEN and rows[1].token == second.tokens[0] == second_alone.tokens[0]
    run(sched)
    assert first.tokens == first_alone.tokens and second.tokens == second_alone.tokens
    assert ranks.most_in_flight == 2
    assert_pools_full(ranks, sched)


def test_a_prompt_in_chunks_rides_along_the_pipeline_one_chunk_a_step() -> None:
    ranks, sched = make()
    long_prompt = list(range(1, 21))  # 20 tokens, over the 16-token budget with a decode row
    _, alone = submit(sched, long_prompt, max_tokens=4, ignore_eos=True)
    run(sched)
    ranks, sched, _, first = _pipelining(4)
    _, second = submit(sched, long_prompt, max_tokens=4, ignore_eos=True)
    run(sched)
    starts = [chunk.start for kind, body in ranks.commands if kind == "unified" for chunk in body[0]]
    assert starts == sorted(set(starts)) and starts[0] == 0 and len(starts) >= 2  # never sent twice
    assert second.tokens == alone.tokens and len(first.tokens) == 20
    assert_pools_full(ranks, sched)


def test_pipelined_cancellation_waits_for_the_step_in_flight() -> None:
    ranks, sched, request, sink = _pipelining(5)
    sched.cancel(request.request_id)
    run(sched)
    assert sink.finish.reason == "cancelled" and 3 <= len(sink.tokens) < 20
    assert ranks.commands[-1] == ("drop", (request.request_id, Expectation.MUST_EXIST, None))
    assert_pools_full(ranks, sched)


def test_dense_slots_and_page_pool_bookkeeping() -> None:
    slots = DenseSlots(3)
    assert [slots.admit(r) for r in (10, 11, 12)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="no free decode slot for request 13: all 3 in use"):
        slots.admit(13)
    assert slots.retire(10) == SlotMove(12, 2, 0)
    assert slots.retire(11) is None
    assert slots.owners == [12]
    pool = PagePool(4, 16)
    pages = pool.allocate(3)
    assert pages == [0, 1, 2] and pool.free == 1
    with pytest.raises(RuntimeError, match="cannot allocate 2 pages: only 1 of 4 free"):
        pool.allocate(2)
    pool.release(pages)
    with pytest.raises(RuntimeError, match="page 0 released but not allocated"):
        pool.release([0])


def test_the_coordinator_seeds_every_request_that_samples() -> None:
    """Sampling with no seed given still sends one in the commands (drawn per request), so rank 0's
    draws follow from the trace; a given seed is kept, and greedy requests carry none."""
    drawn = [GenerationParams(temperature=0.8).sampling(1).seed for _ in range(4)]
    assert all(isinstance(seed, int) and 0 <= seed < 1 << 63 for seed in drawn)
    assert len(set(drawn)) == 4
    assert GenerationParams(temperature=0.8, seed=-5).sampling(1).seed == -5
    assert GenerationParams(temperature=0.0).sampling(1).seed is None
    request = Request(1, [1, 2], GenerationParams(temperature=1.0), emit=lambda _event: None)
    assert request.sampling.seed is not None  # drawn once, when the request is admitted
