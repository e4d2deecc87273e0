"""A request's event stream: filled by the scheduler thread, read by sync or async consumers.

Events are buffered under a lock. A sync reader waits on a condition; an async reader parks a
future on its own event loop, which the producer wakes with ``call_soon_threadsafe``, so any
asyncio loop can consume a stream fed from the scheduler thread. After the final event (finish or
error) the stream ignores anything else: a request ends exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable

from phalanx.scheduler.events import Event, is_final

# A sync reader waits in slices this long. A signal (Ctrl-C, SIGTERM) that the kernel hands to
# another thread does not interrupt a lock's wait in the main thread, and Python runs the
# handler only when the main thread gets back to it: within a slice, not when the next event
# comes (which may be never, or after the ranks' grace has run out).
WAIT_SLICE_S = 0.2


class RequestStream:
    def __init__(
        self, request_id: int, cancel: Callable[[int], None], on_final: Callable[[int], None]
    ) -> None:
        self.request_id = request_id
        self._cancel = cancel
        self._on_final = on_final
        self._events: deque[Event] = deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._ended = False  # the final event was pushed
        self._consumed = False  # the final event was handed to the reader
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    @property
    def finished(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        """Ask the engine to cancel this request (idempotent)."""
        self._cancel(self.request_id)

    def push(self, event: Event) -> bool:
        """Called by the producer; returns False when the stream had already ended."""
        with self._lock:
            if self._ended:
                return False
            self._events.append(event)
            self._ended = is_final(event)
            self._ready.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, future = waiter
            # a reader whose loop has closed (the server stopped) waits for nothing any more
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake, future)
        if is_final(event):
            self._on_final(self.request_id)
        return True

    def _take(self) -> Event | None:
        """Next event or None (caller holds the lock); raises StopIteration after the end."""
        if self._events:
            event = self._events.popleft()
            self._consumed = is_final(event)
            return event
        if self._consumed:
            raise StopIteration
        return None

    # -- sync ---------------------------------------------------------------------------------

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> Event:
        return self.next_event()

    def next_event(self, timeout: float | None = None) -> Event:
        """Block for the next event; raises StopIteration after the final one, TimeoutError on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready:
            event = self._take()
            while event is None:
                wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"no event for request {self.request_id} within {timeout} s")
                self._ready.wait(wait)
                event = self._take()
            return event

    # -- async --------------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            with self._lock:
                try:
                    event = self._take()
                except StopIteration:
                    raise StopAsyncIteration from None
                if event is not None:
                    return event
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiter = (loop, future)
            await future


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
