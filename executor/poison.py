"""The executor's poison flag: the first reason wins and every later call fails with it."""

from __future__ import annotations

import structlog

from phalanx.executor.errors import ExecutorPoisoned

log = structlog.get_logger("phalanx.executor")


class Poison:
    def __init__(self) -> None:
        self.reason: str | None = None

    def set(self, reason: str) -> ExecutorPoisoned:
        """Poison with ``reason`` unless already poisoned; returns the error to raise."""
        if self.reason is None:
            self.reason = reason
            log.error("executor poisoned", reason=reason)
        return ExecutorPoisoned(self.reason)

    def ensure_healthy(self) -> None:
        if self.reason is not None:
            raise ExecutorPoisoned(self.reason)
