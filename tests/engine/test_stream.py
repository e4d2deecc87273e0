"""A request stream's sync reader lets signal handlers run while it waits, also when the kernel
delivered the signal to another thread (which does not interrupt the main thread's wait). Async
readers on one loop, fed from another thread, get every event, woken in batches."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from phalanx.engine.stream import WAIT_SLICE_S, RequestStream
from phalanx.scheduler.events import FinishEvent, TokenEvent


class _Stopped(Exception):
    pass


def _raise_stopped(_signum: int, _frame: object) -> None:
    raise _Stopped


def test_a_signal_taken_by_another_thread_reaches_a_waiting_reader() -> None:
    stream = RequestStream(7, cancel=lambda _id: None, on_final=lambda _id: None)

    def signal_from_elsewhere() -> None:
        time.sleep(0.1)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # handled on this thread's behalf
        time.sleep(5.0)
        stream.push(FinishEvent("stop", 1, 0))  # the next event: what an unsliced wait would wake for

    previous = signal.signal(signal.SIGUSR1, _raise_stopped)
    try:
        threading.Thread(target=signal_from_elsewhere, daemon=True).start()
        started = time.monotonic()
        with pytest.raises(_Stopped):
            stream.next_event()
        assert time.monotonic() - started < 0.1 + WAIT_SLICE_S + 1.0
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_timed_wait_still_times_out_with_its_own_timeout() -> None:
    stream = RequestStream(8, cancel=lambda _id: None, on_final=lambda _id: None)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no event for request 8 within 0.5 s"):
        stream.next_event(timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 0.5 + WAIT_SLICE_S + 0.5


def test_async_readers_fed_from_a_thread_get_every_event_with_batched_wakeups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    streams = [RequestStream(i, lambda _: None, lambda _: None) for i in range(32)]
    rounds = 50

    async def read(stream: RequestStream) -> list[int]:
        return [event.token_id async for event in stream if isinstance(event, TokenEvent)]

    def produce() -> None:  # as the scheduler thread does: one event to every stream per step
        for step in range(rounds):
            for stream in streams:
                stream.push(TokenEvent(step))
            time.sleep(0.001 * (step % 3))  # readers caught parked, mid-batch and behind
        for stream in streams:
            stream.push(FinishEvent("length", 1, rounds))

    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        scheduled = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal scheduled
            scheduled += 1
            return call_soon_threadsafe(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        readers = [asyncio.ensure_future(read(stream)) for stream in streams]
        await asyncio.sleep(0.01)  # every reader parked
        producer = threading.Thread(target=produce)
        producer.start()
        tokens = await asyncio.wait_for(asyncio.gather(*readers), timeout=30)
        producer.join()
        return tokens, scheduled

    tokens, scheduled = asyncio.run(run())
    assert tokens == [list(range(rounds))] * len(streams)
    assert scheduled < len(streams) * rounds / 4  # one wake-up serves many readers
