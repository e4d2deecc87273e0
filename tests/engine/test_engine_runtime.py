"""The scheduler and engine through the REAL runtime: rank processes on CPU, the tiny model.

One engine per TP degree for the whole module (launching is the expensive part). The engine's
executor is wrapped in ``HeldExecutor``, which forwards every call to the real executor and can
hold the scheduler thread right after a chosen command is sent, so a test can cancel a request in an
exact phase. Rank state is checked at the end through the real ranks (MustBeAbsent drops).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phalanx.engine.engine import (
    Engine,
    EngineConfig,
    ErrorEvent,
    FinishEvent,
    GenerationParams,
    TokenEvent,
    launch,
)
from phalanx.protocol.messages import Decode, DropRequest, Expectation, Prefill, Unified
from tests.support.runtime_helpers import rank_pids

KV_PAGES, PAGE_SIZE, MAX_SLOTS, MAX_BATCH_TOKENS = 32, 4, 16, 24
MAX_CONTEXT = KV_PAGES * PAGE_SIZE  # below the tiny model's 2048 positions


class HeldExecutor:
    """Forwards to the real executor; ``hold_after(predicate)`` parks the scheduler thread after
    the first command (name, args) that matches, until ``release()``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.commands: list[tuple[str, tuple]] = []
        self._predicate: Callable[[str, tuple], bool] | None = None
        self._held = threading.Event()
        self._go = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def hold_after(self, predicate: Callable[[str, tuple], bool]) -> None:
        self._held.clear()
        self._go.clear()
        self._predicate = predicate

    def wait_held(self) -> None:
        assert self._held.wait(60), "the engine never reached the held command"

    def release(self) -> None:
        self._predicate = None
        self._go.set()

    def send(self, command):
        handle = self.inner.send(command)
        name, args = command_args(command)
        if name:
            self.commands.append((name, args))
        if name and self._predicate is not None and self._predicate(name, args):
            self._predicate = None
            self._held.set()
            assert self._go.wait(60), "the test never released the engine"
        return handle


def command_args(command) -> tuple[str, tuple]:
    """A step command as (name, args): what a test's predicates read."""
    match command:
        case Prefill(chunks=chunks):
            return "prefill", (chunks,)
        case Decode(rows=rows):
            return "decode", (rows,)
        case Unified(prefill=chunks, decode=rows):
            return "unified", (chunks, rows)
        case DropRequest(request_id=request_id, expectation=expectation, move=move):
            return "drop", (request_id, expectation, move)
    return "", ()


def chunk_ids(name: str, args: tuple) -> list[tuple[int, int, bool]]:
    chunks = args[0] if name in ("prefill", "unified") else []
    return [(c.request_id, c.start, c.last) for c in chunks]


def row_ids(name: str, args: tuple) -> list[int]:
    rows = args[0] if name == "decode" else args[1] if name == "unified" else []
    return [r.request_id for r in rows]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, tiny_model_dir: Path):
    config = EngineConfig(
        model_dir=tiny_model_dir,
        tp=request.param,
        kv_pages=KV_PAGES,
        page_size=PAGE_SIZE,
        max_slots=MAX_SLOTS,
        max_batch_tokens=MAX_BATCH_TOKENS,
        step_timeout=60.0,
        idle_ping_interval=3600.0,  # assert_idle_and_clean drives the executor from the test thread
    )
    engine = Engine.start(config, lambda c: HeldExecutor(launch(c)))
    yield engine
    engine.shutdown()


@functools.cache
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int, stop_at_eos: bool) -> list[int]:
    from transformers import GenerationConfig

    model = hf_model(model_dir)
    eos = model.generation_config.eos_token_id if stop_at_eos else None
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def collect(stream) -> tuple[list[int], FinishEvent | ErrorEvent]:
    events = list(stream)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return [e.token_id for e in events[:-1]], events[-1]


def assert_idle_and_clean(engine: Engine, request_ids: list[int]) -> None:
    """Pools full in the scheduler, and no rank holds state for any of the requests."""
    deadline = time.monotonic() + 10
    while engine.stats().running + engine.stats().waiting and time.monotonic() < deadline:
        time.sleep(0.01)  # the final event is published just before the stats snapshot
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_pages_used, stats.slots_used) == (0, 0, 0, 0)
    assert stats.kv_pages_total == KV_PAGES and stats.slots_total == MAX_SLOTS
    assert engine.poison_reason is None
    # The scheduler thread is idle (nothing open), so the test thread may use the executor.
    for request_id in request_ids:
        engine._executor.inner.call(DropRequest(request_id, Expectation.MUST_BE_ABSENT))


def prompt_of(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, 380) for _ in range(length)]


def test_greedy_matches_transformers_generate(engine: Engine, tiny_model_dir: Path) -> None:
    rng = random.Random(1)
    cases = [(prompt_of(rng, n), k) for n, k in [(1, 8), (7, 6), (30, 5), (61, 4)]]  # 30, 61: chunked
    for prompt, max_tokens in cases:
        tokens, final = collect(
            engine.submit(prompt, GenerationParams(max_tokens=max_tokens, ignore_eos=True))
        )
        assert tokens == hf_greedy(tiny_model_dir, prompt, max_tokens, stop_at_eos=False)
        assert final == FinishEvent("length", len(prompt), max_tokens)
    prompt = cases[1][0]
    events = list(engine.submit(prompt, GenerationParams(max_tokens=1, logprobs=3)))
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(tiny_model_dir)(torch.tensor([prompt])).logits[0, -1], dim=-1)
    top = torch.sort(reference, descending=True, stable=True)
    first = events[0]
    assert [token for token, _ in first.top_logprobs] == top.indices[:3].tolist()
    assert [value for _, value in first.top_logprobs] == pytest.approx(top.values[:3].tolist(), abs=1e-4)
    assert first.token_id == top.indices[0].item() and first.logprob == pytest.approx(
        top.values[0].item(), abs=1e-4
    )
    tokens, final = collect(engine.submit(prompt, GenerationParams(max_tokens=6)))
    expected = hf_greedy(tiny_model_dir, prompt, 6, stop_at_eos=True)
    assert tokens == expected
    assert final.reason == ("stop" if expected[-1] in engine.model_info.eos_token_ids else "length")


def test_concurrent_requests_match_each_alone(engine: Engine) -> None:
    if engine._executor.world_size != 2:
        pytest.skip("run at TP=2 only, to keep the suite fast")
    rng = random.Random(2)
    work = []
    for index in range(16):
        params = GenerationParams(max_tokens=rng.randint(1, 6), ignore_eos=True)
        if index % 2:
            params = GenerationParams(
                max_tokens=params.max_tokens,
                ignore_eos=True,
                temperature=0.9,
                top_p=0.9,
                top_k=40,
                seed=index,
            )
        work.append((prompt_of(rng, rng.randint(1, 30)), params))
    alone = [collect(engine.submit(prompt, params))[0] for prompt, params in work]
    streams = [engine.submit(prompt, params) for prompt, params in work]
    together = [collect(stream) for stream in streams]
    assert [tokens for tokens, _ in together] == alone
    assert [final.reason for _, final in together] == ["length"] * 16
    assert [len(tokens) for tokens in alone] == [params.max_tokens for _, params in work]
    kinds = {name for name, _ in engine._executor.commands}
    assert {"prefill", "decode", "unified", "drop"} <= kinds
    assert_idle_and_clean(engine, [s.request_id for s in streams])


def _cancel_when(engine: Engine, predicate, submit) -> tuple[list, int]:
    """Hold the engine after the first command matching ``predicate(name, args, ids)``, cancel
    the target request there, and collect every stream."""
    executor = engine._executor
    ids: dict[str, int] = {}
    executor.hold_after(lambda name, args: predicate(name, args, ids))
    streams = submit(ids)
    executor.wait_held()
    target = ids["target"]
    engine.cancel(target)
    executor.release()
    results = [collect(stream) for stream in streams]
    drop = next(args for name, args in executor.commands if name == "drop" and args[0] == target)
    return results, drop


@pytest.mark.parametrize("phase", ["waiting", "prefilling", "ready", "decoding"])
def test_cancellation_in_every_phase_leaks_nothing(engine: Engine, phase: str) -> None:
    rng = random.Random(3)
    executor = engine._executor
    start = len(executor.commands)

    def submit(ids: dict[str, int]) -> list:
        if phase == "waiting":
            # The blocker reserves 27 of 32 pages, so the target (8 pages) waits behind it.
            blocker = engine.submit(prompt_of(rng, 100), GenerationParams(max_tokens=8, ignore_eos=True))
            target = engine.submit(prompt_of(rng, 20), GenerationParams(max_tokens=10, ignore_eos=True))
            ids |= {"target": target.request_id, "blocker": blocker.request_id}
            return [blocker, target]
        if phase == "decoding":
            streams = [
                engine.submit(prompt_of(rng, 5), GenerationParams(max_tokens=6, ignore_eos=True))
                for _ in range(3)
            ]
            ids |= {"target": streams[0].request_id, "middle": streams[1].request_id}
            ids["last"] = streams[2].request_id
            return streams
        target = engine.submit(prompt_of(rng, 60), GenerationParams(max_tokens=8, ignore_eos=True))
        ids["target"] = target.request_id
        return [target]

    def hold_here(name: str, args: tuple, ids: dict[str, int]) -> bool:
        target = ids.get("target")
        if phase == "waiting":
            return ids.get("blocker") in row_ids(name, args)
        if phase == "prefilling":
            return any(rid == target and not last for rid, _, last in chunk_ids(name, args))
        if phase == "ready":
            return any(rid == target and last for rid, _, last in chunk_ids(name, args))
        return row_ids(name, args) == [target, ids.get("middle"), ids.get("last")]

    results, drop = _cancel_when(engine, hold_here, submit)
    target_result = results[1] if phase == "waiting" else results[0]
    assert target_result[1].reason == "cancelled"
    expected = {
        "waiting": (Expectation.MUST_BE_ABSENT, None),
        "prefilling": (Expectation.MUST_EXIST, None),
        "ready": (Expectation.MUST_EXIST, None),
    }
    if phase == "decoding":
        assert drop[1] is Expectation.MUST_EXIST and drop[2] is not None
        assert (drop[2].from_slot, drop[2].to_slot) == (2, 0)
        assert [final.reason for _, final in results[1:]] == ["length", "length"]
    else:
        assert drop[1:] == expected[phase]
    if phase == "waiting":
        assert results[0][1].reason == "length"
        # The target was never sent to the ranks.
        sent = [rid for name, args in executor.commands[start:] for rid, _, _ in chunk_ids(name, args)]
        assert drop[0] not in sent
    assert_idle_and_clean(engine, [drop[0]])


def test_full_pool_queues_requests_instead_of_failing(engine: Engine) -> None:
    rng = random.Random(4)
    executor = engine._executor
    # Each request reserves 19 of the 32 pages: only one fits at a time.
    executor.hold_after(lambda name, args: bool(row_ids(name, args)))
    streams = [
        engine.submit(prompt_of(rng, 70), GenerationParams(max_tokens=4, ignore_eos=True)) for _ in range(3)
    ]
    executor.wait_held()
    stats = engine.stats()
    assert stats.waiting == 2 and stats.running == 1 and stats.kv_pages_used == 19
    executor.release()
    assert [collect(s)[1].reason for s in streams] == ["length"] * 3
    assert_idle_and_clean(engine, [s.request_id for s in streams])


def test_prompt_longer_than_the_context_is_refused(engine: Engine) -> None:
    assert engine.model_info.max_context == MAX_CONTEXT
    with pytest.raises(
        ValueError, match=f"prompt of {MAX_CONTEXT} tokens is too long: the context holds {MAX_CONTEXT}"
    ):
        engine.submit([1] * MAX_CONTEXT, GenerationParams(max_tokens=1))
    with pytest.raises(ValueError, match=f"plus max_tokens 20 exceeds the context of {MAX_CONTEXT} tokens"):
        engine.submit([1] * (MAX_CONTEXT - 10), GenerationParams(max_tokens=20))
    assert engine.stats().waiting == 0


def test_soak_of_random_requests_with_random_cancellations(engine: Engine, tiny_model_dir: Path) -> None:
    if engine._executor.world_size != 2:
        pytest.skip("run at TP=2 only, to keep the suite fast")
    rng = random.Random(5)
    streams, params_of = [], {}
    for _ in range(500):
        params = GenerationParams(
            max_tokens=rng.randint(1, 3),
            temperature=rng.choice([0.0, 1.0]),
            seed=rng.randrange(100),
            ignore_eos=rng.random() < 0.5,
        )
        stream = engine.submit(prompt_of(rng, rng.randint(1, 8)), params)
        streams.append(stream)
        params_of[stream.request_id] = params
        if rng.random() < 0.25:
            engine.cancel(rng.choice(streams).request_id)
    reasons = []
    for stream in streams:
        tokens, final = collect(stream)
        assert isinstance(final, FinishEvent), final
        assert final.completion_tokens == len(tokens) <= params_of[stream.request_id].max_tokens
        if final.reason == "length":
            assert len(tokens) == params_of[stream.request_id].max_tokens
        reasons.append(final.reason)
    assert "cancelled" in reasons and "length" in reasons
    assert_idle_and_clean(engine, [s.request_id for s in rng.sample(streams, 20)])
    prompt = prompt_of(rng, 9)
    assert collect(engine.submit(prompt, GenerationParams(max_tokens=5, ignore_eos=True)))[0] == hf_greedy(
        tiny_model_dir, prompt, 5, stop_at_eos=False
    )


def test_a_dead_rank_poisons_the_engine_and_every_open_request_gets_one_error(engine: Engine) -> None:
    """Runs last for each engine (it kills a rank): requests in decode, in prefill and waiting."""
    rng = random.Random(6)
    executor = engine._executor
    executor.hold_after(lambda name, args: len(row_ids(name, args)) == 2)
    streams = [
        engine.submit(prompt_of(rng, 4), GenerationParams(max_tokens=20, ignore_eos=True)) for _ in range(2)
    ]
    executor.wait_held()
    streams.append(engine.submit(prompt_of(rng, 60), GenerationParams(max_tokens=4, ignore_eos=True)))
    streams.append(
        engine.submit(prompt_of(rng, 90), GenerationParams(max_tokens=4, ignore_eos=True))
    )  # waits
    victim = executor.world_size - 1
    os.kill(rank_pids(executor.inner)[victim], signal.SIGKILL)
    executor.release()
    for stream in streams:
        events = list(stream)
        finals = [e for e in events if not isinstance(e, TokenEvent)]
        assert len(finals) == 1 and isinstance(finals[0], ErrorEvent), events
        assert finals[0].message.startswith("engine is poisoned: ") and f"rank {victim}" in finals[0].message
    assert engine.poison_reason is not None and f"rank {victim}" in engine.poison_reason
    with pytest.raises(RuntimeError, match="engine is poisoned"):
        engine.submit([1], GenerationParams())
    assert engine.stats().running == 0
