"""Rejected frames, counted and logged at a bounded rate.

A peer that floods a socket with forged or undecodable frames must not flood the log too: the first
``DETAILED`` rejections are logged one line each, later ones as one summary line (the totals by
reason) at most once per ``SUMMARY_INTERVAL_S``. The counts are exact whatever is logged.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

DETAILED = 10
SUMMARY_INTERVAL_S = 1.0


class RejectionLog:
    def __init__(self, logger: Any, event: str) -> None:
        self._log = logger
        self._event = event
        self.by_reason: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._last_summary = 0.0

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def record(self, reason: str, **detail: Any) -> None:
        """Count one rejection; log it, or a summary, or nothing, by the rate above."""
        with self._lock:
            self.by_reason[reason] += 1
            total = self.total
            now = time.monotonic()
            summarise = total > DETAILED and now - self._last_summary >= SUMMARY_INTERVAL_S
            if summarise:
                self._last_summary = now
            by_reason = dict(self.by_reason)
        if total <= DETAILED:
            self._log.warning(self._event, reason=reason, rejected=total, **detail)
        elif summarise:
            self._log.warning(f"{self._event} (summary)", rejected=total, by_reason=by_reason)
