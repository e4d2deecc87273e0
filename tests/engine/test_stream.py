"""A request stream's sync reader lets signal handlers run while it waits, also when the kernel
delivered the signal to another thread (which does not interrupt the main thread's wait)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from phalanx.engine.stream import WAIT_SLICE_S, RequestStream
from phalanx.scheduler.events import FinishEvent


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
