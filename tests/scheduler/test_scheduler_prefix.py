"""Prefix caching through the scheduler, against the test double of the ranks (which checks every
restore against the snapshot slot's key and position and the cached pages' tokens, and refuses a
write into a page another request holds): a hit gives the tokens a miss gives, mid-chunk hits,
eviction under pressure, cancels around a restore, and a soak that ends with everything free."""

from __future__ import annotations

import random

from phalanx.protocol.messages import Expectation
from tests.support.scheduler_driver import assert_pools_full, make, pipelined, run, submit

SYSTEM = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 2, 3, 3, 1, 9, 8, 7, 6, 5]  # five pages of 4


def conversations(rng: random.Random, count: int) -> list[tuple[list[int], dict]]:
    """Prompts that share the system prefix (or part of it), some sampled."""
    work = []
    for index in range(count):
        shared = SYSTEM[: rng.choice([0, 6, 12, 20, 20])]
        prompt = shared + [rng.randrange(60) for _ in range(rng.randint(1, 9))]
        params = {"max_tokens": rng.randint(1, 6), "ignore_eos": True}
        if index % 3 == 1:
            params |= {"temperature": 0.8, "seed": rng.randrange(1000)}
        work.append((prompt, params))
    return work


def outputs(work, **capacity) -> tuple[list[list[int]], object, object]:
    """Each request's tokens, all submitted at once."""
    ranks, sched = make(**capacity)
    sinks = [submit(sched, prompt, **params)[1] for prompt, params in work]
    run(sched)
    assert all(sink.finish is not None and sink.finish.reason == "length" for sink in sinks)
    assert_pools_full(ranks, sched)
    return [sink.tokens for sink in sinks], ranks, sched


def chunks_of(ranks) -> list:
    return [
        chunk
        for kind, body in ranks.commands
        if kind in ("prefill", "unified")
        for chunk in (body if kind == "prefill" else body[0])
    ]


@pipelined
def test_hits_give_the_tokens_misses_give(pipeline: bool) -> None:
    work = conversations(random.Random(1), 40)
    misses, _, _ = outputs(work, max_slots=4, max_batch_tokens=8, pipeline=pipeline)
    hits, ranks, sched = outputs(
        work, max_slots=4, max_batch_tokens=8, pipeline=pipeline, snapshot_slots=6, snapshot_interval=8
    )
    assert hits == misses
    stats = sched.stats().prefix_cache
    assert ranks.restores == stats.hits > 5 and stats.hit_tokens >= 8 * stats.hits
    restored = [chunk for chunk in chunks_of(ranks) if chunk.restore is not None]
    assert len(restored) == stats.hits
    assert all(chunk.start == chunk.restore.position for chunk in restored)


def test_a_hit_can_end_inside_a_chunk_and_saves_split_nothing() -> None:
    ranks, sched = make(max_batch_tokens=7, snapshot_slots=4, snapshot_interval=8)
    first, _ = submit(sched, SYSTEM + [1, 2, 3], max_tokens=2, ignore_eos=True)
    run(sched)
    # Chunks of 7 over 23 tokens: saves at 8 and 16 fall inside chunks, 20 (the last page
    # boundary before the last token) too.
    saved = [(c.start, len(c.tokens) // 4, [s.position for s in c.save]) for c in chunks_of(ranks)]
    assert saved == [(0, 7, []), (7, 7, [8]), (14, 7, [16, 20]), (21, 2, [])]
    _, sink = submit(sched, SYSTEM + [1, 2, 3], max_tokens=2, ignore_eos=True)
    run(sched)
    hit = chunks_of(ranks)[4:]
    assert [(c.start, len(c.tokens) // 4, c.restore.position if c.restore else None) for c in hit] == [
        (20, 3, 20)
    ]
    assert sink.tokens == first.output
    assert_pools_full(ranks, sched)


def test_eviction_under_pressure_stays_correct() -> None:
    work = conversations(random.Random(2), 60)
    misses, _, _ = outputs(work, kv_pages=24, max_slots=3, max_batch_tokens=6)
    hits, _, sched = outputs(
        work, kv_pages=24, max_slots=3, max_batch_tokens=6, snapshot_slots=2, snapshot_interval=4
    )
    assert hits == misses
    stats = sched.stats().prefix_cache
    assert stats.hits > 0 and stats.evicted_pages > 0 and stats.evicted_snapshots > 0


def test_identical_prompts_in_one_step_cache_one_copy() -> None:
    ranks, sched = make(max_batch_tokens=64, snapshot_slots=4, snapshot_interval=8)
    sinks = [submit(sched, SYSTEM + [5], max_tokens=3, ignore_eos=True)[1] for _ in range(3)]
    run(sched)
    assert sinks[0].tokens == sinks[1].tokens == sinks[2].tokens
    assert [len(c.save) for c in chunks_of(ranks)] == [3, 0, 0]  # one request takes each save
    assert sched.stats().prefix_cache.cached_pages == 5
    assert_pools_full(ranks, sched)


@pipelined
def test_cancel_before_and_after_the_restoring_chunk(pipeline: bool) -> None:
    ranks, sched = make(max_batch_tokens=4, snapshot_slots=2, snapshot_interval=8, pipeline=pipeline)
    submit(sched, SYSTEM + [1], max_tokens=1, ignore_eos=True)
    run(sched)
    # Admitted with a hit, cancelled before its first chunk: never on the ranks, snapshot unpinned.
    early, early_sink = submit(sched, SYSTEM + [2, 3], max_tokens=2, ignore_eos=True)
    busy, _ = submit(sched, list(range(30, 38)), max_tokens=3, ignore_eos=True)
    sched.planner.admit()
    assert early.prefix.restore is not None and early.cursor == 20
    sched.cancel(early.request_id)
    sched.step()
    assert ("drop", (early.request_id, Expectation.MUST_BE_ABSENT, None)) in ranks.commands
    assert early_sink.finish.reason == "cancelled"
    # Cancelled right after the chunk that restores was sent and answered.
    late, late_sink = submit(sched, SYSTEM + [4, 5, 6, 7, 8], max_tokens=4, ignore_eos=True)
    while not any(chunk.request_id == late.request_id for chunk in chunks_of(ranks)):
        sched.step()
    assert chunks_of(ranks)[-1].restore is not None and late.cursor < len(late.prompt)
    sched.cancel(late.request_id)
    run(sched)
    assert late_sink.finish.reason == "cancelled" and busy.phase.value == "done"
    assert_pools_full(ranks, sched)
    _, again = submit(sched, SYSTEM + [2, 3], max_tokens=2, ignore_eos=True)
    run(sched)
    assert chunks_of(ranks)[-1].restore is not None and len(again.tokens) == 2
    assert_pools_full(ranks, sched)


@pipelined
def test_soak_with_shared_prefixes_and_random_cancels_ends_with_everything_free(pipeline: bool) -> None:
    rng = random.Random(3)
    ranks, sched = make(
        kv_pages=40,
        max_slots=6,
        max_batch_tokens=10,
        pipeline=pipeline,
        snapshot_slots=4,
        snapshot_interval=8,
    )
    sinks, open_requests = [], []
    for prompt, params in conversations(rng, 300):
        request, sink = submit(sched, prompt, **params)
        sinks.append(sink)
        open_requests.append(request)
        for _ in range(rng.randint(0, 2)):
            if sched.has_work():
                sched.step()
        if rng.random() < 0.3:
            sched.cancel(rng.choice(open_requests[-6:]).request_id)
    run(sched)
    assert all(sink.finish is not None for sink in sinks)
    assert sum(sink.finish.reason == "cancelled" for sink in sinks) > 30
    stats = sched.stats().prefix_cache
    assert stats.hits > 30 and stats.queries <= 300 and stats.hits <= stats.queries
    assert_pools_full(ranks, sched)
