"""The startup watchdog: a phase that does not finish in time aborts the process.

A wedged NCCL (or gloo) rendezvous cannot be unwound from Python, and a clean exit would run
teardown handlers that take the same wedged locks, so expiry logs and calls ``os.abort()``.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading
from types import TracebackType

import structlog

log = structlog.get_logger("phalanx.worker")


class Watchdog:
    def __init__(self, timeout_s: float, rank: int, phase: str) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.phase = phase
        self._done = threading.Event()
        # Run with the creating thread's log context, so the last line still carries rank/epoch/seq.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._watch,), name=f"phalanx-watchdog-{phase}", daemon=True
        )

    def _watch(self) -> None:
        if self._done.wait(self.timeout_s):
            return
        log.critical(
            "startup watchdog expired; aborting",
            watchdog_rank=self.rank,
            phase=self.phase,
            timeout_s=self.timeout_s,
        )
        sys.stderr.flush()
        os.abort()

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        self._thread.join()
