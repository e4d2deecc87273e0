"""Scheduler logic against a test double of the ranks (tests/support/fake_ranks.py): admission, chunked
prefill, unified steps, dense slots with compaction, cancellation in every phase, completion held
until the drop is acknowledged. Pipelined decode is in test_scheduler_pipeline.py; the
real-runtime versions of these live in tests/engine/test_engine*.py."""

from __future__ import annotations

import random

import pytest

from phalanx.protocol.messages import Expectation, SlotMove
from phalanx.scheduler.events import FinishEvent
from phalanx.scheduler.pages import PagePool
from phalanx.scheduler.requests import GenerationParams, Phase, Request
from phalanx.scheduler.slots import DenseSlots
from tests.support.fake_ranks import RankStateError
from tests.support.scheduler_driver import Sink, assert_pools_full, make, pipelined, run, submit


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
