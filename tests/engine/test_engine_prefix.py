"""Prefix caching through the REAL runtime: rank processes on CPU (gloo), the tiny model, fp32.

A prefix hit must give what a miss gives: the same greedy tokens and logprobs within 1e-4 as an
engine with the prefix cache off (the reference, TP 1), at TP 1 and TP 2, including hits that
start inside what was one chunk of the prompt that saved them, under page and snapshot pressure,
with a cancel while a restore is in flight, and over a soak with random cancels that ends with
every slot free and every page free or cached with no reference.

One engine per configuration for the whole module (launching is the expensive part).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from phalanx.engine.engine import Engine, EngineConfig, FinishEvent, GenerationParams, TokenEvent, launch
from phalanx.protocol.messages import DropRequest, Expectation, PrefillChunk
from tests.engine.test_engine_runtime import HeldExecutor

PAGE_SIZE, KV_PAGES, MAX_SLOTS, MAX_BATCH_TOKENS = 4, 48, 4, 24
SNAPSHOTS, INTERVAL = 6, 8  # few snapshot slots: the workloads below evict them
SYSTEM = [(7 * i + 3) % 380 + 1 for i in range(45)]  # a shared "system prompt"


def start(
    tiny_model_dir: Path,
    tp: int,
    cached: bool,
    page_size: int = PAGE_SIZE,
    graphs: bool = False,
    **capacity: int,
) -> Engine:
    config = EngineConfig(
        model_dir=tiny_model_dir,
        tp=tp,
        cuda_graph=graphs,
        page_size=page_size,
        prefix_cache=cached,
        prefix_snapshot_interval=INTERVAL,
        step_timeout=60.0,
        idle_ping_interval=3600.0,  # assert_clean drives the executor from the test thread
        **(
            dict(kv_pages=KV_PAGES, max_slots=MAX_SLOTS, max_batch_tokens=MAX_BATCH_TOKENS)
            | {"prefix_snapshots": SNAPSHOTS if cached else 0}
            | capacity
        ),
    )
    return Engine.start(config, lambda c: HeldExecutor(launch(c)))


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    engine = start(tiny_model_dir, 1, cached=False)
    assert engine._executor.capacity.snapshot_slots == 0
    yield engine
    engine.shutdown()


# "tp1-graphs": the padded single-chunk prefills of the graph runner, run eagerly on CPU
# (worker/prefill_graphs.py), with the decode graphs' static buffers beside them
@pytest.fixture(scope="module", params=[(1, False), (2, False), (1, True)], ids=["tp1", "tp2", "tp1-graphs"])
def cached(request, tiny_model_dir: Path):
    tp, graphs = request.param
    engine = start(tiny_model_dir, tp, cached=True, graphs=graphs)
    assert engine._executor.capacity.snapshot_slots == SNAPSHOTS
    yield engine
    engine.shutdown()


Result = tuple[list[int], list[float]]


def result(stream) -> Result:
    """A finished stream's tokens, and the logprobs of each one's top 2."""
    events = list(stream)
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length", events[-1]
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    return [e.token_id for e in tokens], [value for e in tokens for _, value in e.top_logprobs]


def greedy(engine: Engine, prompt: list[int], max_tokens: int = 4) -> Result:
    return result(engine.submit(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)))


def greedy_all(engine: Engine, prompts: list[list[int]], max_tokens: int = 4) -> list[Result]:
    """Every prompt submitted at once (they run batched), then read."""
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [result(stream) for stream in [engine.submit(prompt, params) for prompt in prompts]]


def assert_same(hit: Result, miss: Result) -> None:
    assert hit[0] == miss[0]
    assert hit[1] == pytest.approx(miss[1], abs=1e-4)


def chunks(engine: Engine) -> list[PrefillChunk]:
    """Every prompt chunk the engine sent, in order."""
    return [
        chunk
        for name, args in engine._executor.commands
        if name in ("prefill", "unified")
        for chunk in args[0]
    ]


def restores(engine: Engine) -> list[tuple[int, int, int]]:
    """(request id, chunk start, restored position) of every chunk sent that restores."""
    return [(c.request_id, c.start, c.restore.position) for c in chunks(engine) if c.restore is not None]


def assert_clean(engine: Engine, request_ids: list[int], kv_pages: int = KV_PAGES) -> None:
    """Nothing open: every slot free, every page free or cached with no reference, the cache's
    counters consistent, and no rank holds state for any of the requests."""
    deadline = time.monotonic() + 10
    while engine.stats().running + engine.stats().waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_pages_used, stats.slots_used) == (0, 0, 0, 0)
    assert engine.poison_reason is None
    planner = engine._scheduler.planner
    planner.cache.check_idle()
    cache = stats.prefix_cache
    assert planner.pages.free + cache.cached_pages == kv_pages
    assert cache.hits <= cache.queries and cache.hit_tokens >= PAGE_SIZE * cache.hits
    assert cache.hit_tokens % PAGE_SIZE == 0
    for request_id in request_ids:
        engine._executor.inner.call(DropRequest(request_id, Expectation.MUST_BE_ABSENT))


def test_hits_give_what_the_cache_off_gives(cached: Engine, reference: Engine) -> None:
    rng = random.Random(1)
    prompts = [SYSTEM[:n] + [rng.randrange(1, 380) for _ in range(k)] for n, k in [(45, 3), (45, 7), (20, 9)]]
    prompts.append(prompts[1])  # the whole prompt again: a hit at its last page boundary
    hits_before = cached.stats().prefix_cache.hits
    for prompt, miss in zip(prompts, greedy_all(reference, prompts), strict=True):
        assert_same(greedy(cached, prompt), miss)
    assert cached.stats().prefix_cache.hits - hits_before == 3
    assert [position for _, _, position in restores(cached)][-3:] == [44, 16, 48]


def test_hits_with_a_bf16_state_keep_the_tokens_within_its_rounding(tiny_model_dir: Path) -> None:
    """A bf16 recurrent state (the default on CUDA) is rounded where a snapshot is taken, while a
    miss carries fp32 through its chunk: hits give the misses' greedy tokens, and logprobs within
    bf16 rounding (up to 0.014 apart on this model, against 1e-4 with an fp32 state)."""
    reference = start(tiny_model_dir, 1, cached=False, recurrent_state_dtype="bfloat16")
    cached = start(tiny_model_dir, 1, cached=True, recurrent_state_dtype="bfloat16")
    try:
        rng = random.Random(1)
        prompts = [SYSTEM[:n] + [rng.randrange(1, 380) for _ in range(k)] for n, k in [(45, 3), (45, 7)]]
        prompts.append(prompts[1])
        for prompt, miss in zip(prompts, greedy_all(reference, prompts), strict=True):
            hit = greedy(cached, prompt)
            assert hit[0] == miss[0]
            assert hit[1] == pytest.approx(miss[1], abs=3e-2)
        assert [position for _, _, position in restores(cached)] == [44, 48]
    finally:
        reference.shutdown()
        cached.shutdown()


def test_a_hit_inside_what_was_one_chunk(cached: Engine, reference: Engine) -> None:
    """The first prompt runs in chunks of 24 (saves at 8, 16, ... inside them); the second
    restores at 40, inside the first's chunk [24, 48), and prefills on from there."""
    rng = random.Random(2)
    first = [rng.randrange(1, 380) for _ in range(61)]
    second = first[:42] + [rng.randrange(1, 380) for _ in range(9)]
    assert_same(greedy(cached, first), greedy(reference, first))
    assert_same(greedy(cached, second), greedy(reference, second))
    request_id, start, position = restores(cached)[-1]
    assert (start, position) == (40, 40)
    mine = [c for c in chunks(cached) if c.request_id == request_id]
    assert [(c.start, len(c.tokens) // 4, [s.position for s in c.save]) for c in mine] == [(40, 11, [48])]


def test_eviction_under_pressure_keeps_hits_correct(cached: Engine, reference: Engine) -> None:
    rng = random.Random(3)
    families = [[rng.randrange(1, 380) for _ in range(24)] for _ in range(5)]
    work = [rng.choice(families)[: rng.choice([12, 20, 24])] + [rng.randrange(1, 380)] for _ in range(16)]
    before = cached.stats().prefix_cache
    params = GenerationParams(max_tokens=3, ignore_eos=True, logprobs=2)
    streams = [cached.submit(prompt, params) for prompt in work]
    for stream, miss in zip(streams, greedy_all(reference, work, 3), strict=True):
        assert_same(result(stream), miss)
    after = cached.stats().prefix_cache
    assert after.hits > before.hits
    assert after.evicted_pages > before.evicted_pages and after.evicted_snapshots > before.evicted_snapshots
    assert_clean(cached, [s.request_id for s in streams])


def test_cancel_while_a_snapshot_is_restored(cached: Engine, reference: Engine) -> None:
    prompt = SYSTEM[:33] + [5, 6]
    greedy(cached, prompt)
    executor: HeldExecutor = cached._executor
    executor.hold_after(
        lambda name, args: name in ("prefill", "unified") and any(c.restore is not None for c in args[0])
    )
    stream = cached.submit(prompt[:-1] + [9], GenerationParams(max_tokens=8, ignore_eos=True))
    executor.wait_held()
    stream.cancel()
    executor.release()
    assert list(stream)[-1].reason == "cancelled"
    assert restores(cached)[-1][0] == stream.request_id
    assert_clean(cached, [stream.request_id])
    assert_same(greedy(cached, prompt[:-1] + [9]), greedy(reference, prompt[:-1] + [9]))


def test_cancel_of_an_admitted_hit_before_its_first_chunk(cached: Engine, reference: Engine) -> None:
    """The long prompt ahead of it takes each step's whole token budget, so the hit is admitted
    (its snapshot pinned) but sends nothing; cancelled then, it never reaches the ranks."""
    rng = random.Random(5)
    cached_prompt = SYSTEM[:29] + [7, 7]
    greedy(cached, cached_prompt)
    long_prompt = [rng.randrange(1, 380) for _ in range(61)]
    executor: HeldExecutor = cached._executor
    # Only the long prompt has a chunk at 24 (the hit's starts at 28): hold after it is sent.
    executor.hold_after(lambda name, args: name == "prefill" and any(c.start == 24 for c in args[0]))
    ahead = cached.submit(long_prompt, GenerationParams(max_tokens=3, ignore_eos=True, logprobs=2))
    hit = cached.submit(cached_prompt[:-1] + [8], GenerationParams(max_tokens=3, ignore_eos=True))
    executor.wait_held()
    assert cached._scheduler.planner.requests[hit.request_id].prefix.restore is not None  # admitted
    hit.cancel()
    executor.release()
    assert list(hit)[-1].reason == "cancelled"
    assert_same(result(ahead), greedy(reference, long_prompt, 3))
    commands = executor.commands
    assert ("drop", (hit.request_id, Expectation.MUST_BE_ABSENT, None)) in commands
    assert hit.request_id not in {chunk.request_id for chunk in chunks(cached)}
    assert_clean(cached, [hit.request_id, ahead.request_id])


def test_soak_with_shared_prefixes_and_random_cancels(tiny_model_dir: Path) -> None:
    """500 short requests on their own engine (TP 1, 16 slots: the module's 4 would make it
    slow), a few shared prefixes, 15 % cancelled at random while they run."""
    rng = random.Random(4)
    engine = start(tiny_model_dir, 1, cached=True, kv_pages=96, max_slots=16, max_batch_tokens=64)
    try:
        streams, cancelled = [], []
        for index in range(500):
            shared = SYSTEM[: rng.choice([0, 8, 16, 24])]
            prompt = shared + [rng.randrange(1, 380) for _ in range(rng.randint(1, 6))]
            params = GenerationParams(max_tokens=rng.randint(1, 3), ignore_eos=True)
            streams.append(engine.submit(prompt, params))
            if rng.random() < 0.15:
                cancelled.append(rng.choice(streams[-8:]))
                cancelled[-1].cancel()
            if index % 25 == 24:
                time.sleep(0.01)  # let the scheduler catch up now and then
        finals = [list(stream)[-1] for stream in streams]
        assert all(isinstance(final, FinishEvent) for final in finals)
        assert sum(final.reason == "cancelled" for final in finals) > 20
        cache = engine.stats().prefix_cache
        assert cache.hits > 100 and 400 < cache.queries <= 500  # a request cancelled while queued: none
        checked = {stream.request_id for stream in cancelled + streams[::10]}
        assert_clean(engine, sorted(checked), kv_pages=96)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_saves_on_the_grid_are_taken_in_the_chunks_own_pass_and_hit(
    tiny_model_dir: Path, reference: Engine, tp: int
) -> None:
    """Pages of 16 and one 256-token chunk per prompt: the saves fall on the ranks' free grid
    (64 and 128: captured inside the pass, no second wave), and a prompt sharing 150 tokens
    restores at 128 and gives what the cache off gives."""
    engine = start(tiny_model_dir, tp, cached=True, page_size=16, kv_pages=64, max_batch_tokens=256)
    try:
        engine._scheduler.planner.cache.snapshot_interval = 64
        rng = random.Random(9)
        first = [rng.randrange(1, 380) for _ in range(180)]
        second = first[:150] + [rng.randrange(1, 380) for _ in range(30)]
        for prompt in (first, second):
            assert_same(greedy(engine, prompt), greedy(reference, prompt))
        sent = chunks(engine)
        assert [(c.start, [s.position for s in c.save]) for c in sent] == [(0, [64, 128]), (128, [])]
        assert restores(engine) == [(sent[1].request_id, 128, 128)]
    finally:
        engine.shutdown()
