"""A request's event stream: filled by the scheduler thread, read by sync or async consumers.

Events are buffered under a lock. A sync reader waits on a condition; an async reader parks a
future on its own event loop, which the producer wakes through that loop's ``_Wakeups`` (one
``call_soon_threadsafe`` for all the readers a step wakes), so any asyncio loop can consume a
stream fed from the scheduler thread. After the final event (finish or error) the stream ignores
anything else: a request ends exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
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
        self._waiter: tuple[_Wakeups, asyncio.Future[None]] | None = None

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
            wakeups, future = waiter
            wakeups.add(future)
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
                self._waiter = (_wakeups_of(loop), future)
            await future


class _Wakeups:
    """The parked readers of one event loop, woken by one callback. The scheduler thread pushes a
    step's token to every stream at once; a ``call_soon_threadsafe`` each would write the loop's
    self-pipe once per stream (a system call on each side, ~9 % of the loop at concurrency 64)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the registry is keyed weakly by the loop
        self._lock = threading.Lock()
        self._futures: list[asyncio.Future[None]] = []

    def add(self, future: asyncio.Future[None]) -> None:
        """Called by the producer: the first future since the last wake-up schedules it."""
        with self._lock:
            self._futures.append(future)
            if len(self._futures) > 1:
                return
        loop = self._loop()
        # a reader whose loop has closed (the server stopped) waits for nothing any more
        with contextlib.suppress(RuntimeError):
            if loop is not None:
                loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        for future in futures:
            if not future.done():
                future.set_result(None)


_WAKEUPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Wakeups] = weakref.WeakKeyDictionary()
_WAKEUPS_LOCK = threading.Lock()


def _wakeups_of(loop: asyncio.AbstractEventLoop) -> _Wakeups:
    wakeups = _WAKEUPS.get(loop)
    if wakeups is None:
        with _WAKEUPS_LOCK:
            wakeups = _WAKEUPS.setdefault(loop, _Wakeups(loop))
    return wakeups
