"""Engine API over a test double of the ranks: streams (sync and async), cancel, validation,
poison fan-out. The same behaviour through real rank processes: tests/engine/test_engine_runtime.py."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from phalanx.engine.engine import Engine, ErrorEvent, FinishEvent, GenerationParams, TokenEvent
from phalanx.executor.errors import ExecutorPoisoned
from phalanx.executor.model_info import ModelInfo
from phalanx.protocol.messages import Capacity, Command, Decode, Ping
from tests.support.fake_ranks import FakeRanks, fake_token


class DoubleExecutor(FakeRanks):
    """FakeRanks plus what the engine needs; ``fail_decode`` poisons it like a failed rank would."""

    def __init__(self, capacity: Capacity) -> None:
        super().__init__(capacity, vocab=64)
        self.model_info = ModelInfo(
            vocab_size=64, eos_token_ids=(63,), max_position_embeddings=64, model_type="fake"
        )
        self.poison_reason: str | None = None
        self.fail_decode = False
        self.shutdowns = 0
        self.pings = 0
        self.fail_ping = False
        self.gate = threading.Event()
        self.gate.set()

    def send(self, command: Command) -> int:
        if isinstance(command, Decode):
            self.gate.wait(10)
            if self.fail_decode:
                self.poison_reason = "rank 1 failed during decode: injected"
                raise ExecutorPoisoned(self.poison_reason)
        if isinstance(command, Ping):
            self.pings += 1
            if self.fail_ping:
                self.poison_reason = "rank 0 exited with code -9 during ping"
                raise ExecutorPoisoned(self.poison_reason)
        return super().send(command)

    def shutdown(self) -> bool:
        self.shutdowns += 1
        return True


def _engine(pipeline: bool = False) -> Engine:
    executor = DoubleExecutor(Capacity(kv_pages=16, page_size=4, max_slots=4, max_batch_tokens=8))
    return Engine(executor, "/models/fake-model", idle_ping_interval=0.05, pipeline=pipeline)


@pytest.fixture
def engine():
    engine = _engine()
    yield engine
    engine.shutdown()


def tokens_and_final(stream) -> tuple[list[int], FinishEvent | ErrorEvent]:
    events = list(stream)
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    return [e.token_id for e in events[:-1]], events[-1]


def test_model_info_bounds_context_by_the_kv_pool(engine: Engine) -> None:
    info = engine.model_info
    assert (info.vocab_size, info.eos_token_ids, info.max_context, info.model_name) == (
        64,
        (63,),
        64,
        "fake-model",
    )


def test_sync_and_async_streams_give_the_same_tokens(engine: Engine) -> None:
    params = GenerationParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=5)
    tokens, final = tokens_and_final(engine.submit([1, 2, 3], params))
    assert len(tokens) == 6 and final == FinishEvent("length", 3, 6)

    async def consume() -> list:
        return [event async for event in engine.submit([1, 2, 3], params)]

    events = asyncio.run(consume())
    assert [e.token_id for e in events[:-1]] == tokens and events[-1] == final
    # The stats snapshot is published after the tick that emitted the final event.
    deadline = time.monotonic() + 5.0
    while engine.stats().kv_pages_used and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.slots_used == 0 and stats.steps > 0


def _idle(engine: Engine) -> None:
    """Wait for the stats snapshot of the tick that retired the last request."""
    deadline = time.monotonic() + 5.0
    while (engine.stats().kv_pages_used or engine.stats().slots_used) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (engine.stats().kv_pages_used, engine.stats().slots_used) == (0, 0)


@pytest.fixture(params=[False, True], ids=["plain", "pipelined"])
def either_engine(request: pytest.FixtureRequest):
    engine = _engine(pipeline=request.param)
    yield engine
    engine.shutdown()


def test_a_prompt_only_request_generates_nothing_and_frees_what_it_held(either_engine: Engine) -> None:
    engine = either_engine
    # a prompt whose one sampled token is the end of sequence: still "length", still no token
    eos_prompt = next(
        [k] for k in range(64) if fake_token([k], GenerationParams(max_tokens=1).sampling(1, (63,)), 64) == 63
    )
    running = engine.submit([1, 2, 3], GenerationParams(max_tokens=5, ignore_eos=True))
    ids = [running.request_id]
    for prompt in ([4, 5, 6, 7, 8], eos_prompt):
        stream = engine.submit(prompt, GenerationParams(max_tokens=0, logprobs=2, seed=1))
        ids.append(stream.request_id)
        assert list(stream) == [FinishEvent("length", len(prompt), 0)]
    tokens, final = tokens_and_final(running)  # a request beside them runs on untouched
    assert len(tokens) == 5 and final == FinishEvent("length", 3, 5)
    _idle(engine)
    # each ran on the ranks and was dropped there
    assert sorted(c[0] for name, c in engine._executor.commands if name == "drop") == sorted(ids)


def test_a_cancelled_prompt_only_request_ends_cancelled(engine: Engine) -> None:
    engine._executor.gate.clear()  # a decode holds the scheduler: the prompt-only one waits behind it
    first = engine.submit([1, 2], GenerationParams(max_tokens=4, ignore_eos=True))
    assert isinstance(first.next_event(timeout=10), TokenEvent)
    waiting = engine.submit([3, 4], GenerationParams(max_tokens=0))
    waiting.cancel()
    engine._executor.gate.set()
    assert list(waiting) == [FinishEvent("cancelled", 2, 0)]
    assert tokens_and_final(first)[1].reason == "length"
    _idle(engine)


def test_cancel_ends_the_stream_once_and_is_idempotent(engine: Engine) -> None:
    engine._executor.gate.clear()  # hold the first decode so the request is surely running
    stream = engine.submit([1, 2], GenerationParams(max_tokens=40, ignore_eos=True))
    first = stream.next_event(timeout=10)
    assert isinstance(first, TokenEvent)
    stream.cancel()
    engine.cancel(stream.request_id)
    engine._executor.gate.set()
    tokens, final = tokens_and_final(stream)
    assert final.reason == "cancelled" and final.completion_tokens == len(tokens) + 1
    engine.cancel(stream.request_id)
    engine.cancel(12345)  # unknown ids are ignored
    assert tokens_and_final(engine.submit([4], GenerationParams(max_tokens=2)))[1].reason in (
        "length",
        "stop",
    )


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], GenerationParams(), "prompt is empty"),
        ([1, 64], GenerationParams(), r"prompt token 64 at index 1 is outside the vocabulary \[0, 64\)"),
        ([3, 5, -1], GenerationParams(), r"prompt token -1 at index 2 is outside the vocabulary \[0, 64\)"),
        ([3, True], GenerationParams(), r"prompt token True at index 1 is outside the vocabulary \[0, 64\)"),
        ([3, 1.0], GenerationParams(), r"prompt token 1.0 at index 1 is outside the vocabulary \[0, 64\)"),
        (
            [1] * 64,
            GenerationParams(max_tokens=1),
            "prompt of 64 tokens is too long: the context holds 64 tokens",
        ),
        (
            [1] * 60,
            GenerationParams(max_tokens=5),
            "prompt of 60 tokens plus max_tokens 5 exceeds the context of 64",
        ),
        ([1], GenerationParams(max_tokens=-1), r"max_tokens must be an integer in \[0, 2147483647\]"),
        ([1], GenerationParams(max_tokens=True), r"max_tokens must be an integer in \[0, 2147483647\]"),
        ([1], GenerationParams(max_tokens=False), r"max_tokens must be an integer in \[0, 2147483647\]"),
        (
            [1],
            GenerationParams(max_tokens=0, min_tokens=1),
            r"min_tokens must be an integer in \[0, max_tokens\], got 1",
        ),
        ([1], GenerationParams(temperature=-1.0), r"temperature must be a number in \[0, 2\]"),
        ([1], GenerationParams(temperature=2.5), r"temperature must be a number in \[0, 2\]"),
        ([1], GenerationParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        ([1], GenerationParams(top_k=-2), r"top_k must be an integer in \[0, 2147483647\]"),
        ([1], GenerationParams(top_k=2**63), r"top_k must be an integer in \[0, 2147483647\]"),
        ([1], GenerationParams(seed=2**63), "seed must be a 64-bit signed integer"),
        ([1], GenerationParams(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    ],
)
def test_invalid_input_is_refused_before_queueing(engine: Engine, prompt, params, message) -> None:
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, params)
    assert engine.stats().waiting == 0


def test_integer_ids_of_any_integral_type_are_taken_as_ints(engine: Engine) -> None:
    """numpy's integers pass the per-token check that plain ints skip, and run as plain ints."""
    import numpy as np

    plain = tokens_and_final(engine.submit([5, 9, 2], GenerationParams(max_tokens=3)))[0]
    numpy_ids = tokens_and_final(engine.submit(list(np.array([5, 9, 2])), GenerationParams(max_tokens=3)))[0]
    assert numpy_ids == plain


def test_poison_gives_every_open_request_exactly_one_error(engine: Engine) -> None:
    executor = engine._executor
    executor.gate.clear()
    streams = [
        engine.submit([i + 1] * (i + 1), GenerationParams(max_tokens=30, ignore_eos=True)) for i in range(7)
    ]
    executor.fail_decode = True
    executor.gate.set()
    for stream in streams:
        events = list(stream)
        assert [type(e) for e in events if not isinstance(e, TokenEvent)] == [ErrorEvent]
        assert events[-1].message == "engine is poisoned: rank 1 failed during decode: injected"
    assert engine.poison_reason == "rank 1 failed during decode: injected"
    assert executor.shutdowns == 1
    with pytest.raises(RuntimeError, match="engine is poisoned: rank 1 failed"):
        engine.submit([1], GenerationParams())


def test_an_idle_engine_pings_and_notices_a_dead_rank(engine: Engine) -> None:
    executor = engine._executor
    deadline = time.monotonic() + 10
    while executor.pings < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert executor.pings >= 2 and engine.poison_reason is None
    executor.fail_ping = True
    while engine.poison_reason is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.poison_reason == "rank 0 exited with code -9 during ping"
    with pytest.raises(RuntimeError, match="engine is poisoned: rank 0 exited"):
        engine.submit([1], GenerationParams())
