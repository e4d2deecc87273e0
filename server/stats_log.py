"""The periodic stats line: every few seconds while the server is busy, one ``info`` line with
prompt and generation throughput, running and waiting requests, KV pages and decode slots in use,
and the prefix cache's hit rate once it has looked a request up.

Busy means a request was open at the tick or tokens moved since the last one, so the line after a
burst (throughput falling to zero) is written once, and an idle server writes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from phalanx.engine.engine import EngineStats
from phalanx.server.metrics import TokenTotals

log = structlog.get_logger("phalanx.stats")


class StatsLog:
    def __init__(self, stats: Callable[[], EngineStats], totals: TokenTotals, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"the stats interval must be positive, got {interval_s}")
        self._stats = stats
        self._totals = totals
        self.interval_s = interval_s
        self._last = (time.monotonic(), totals.prompt, totals.generation)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-stats-log", daemon=True)

    def fields(self, now: float) -> dict[str, Any] | None:
        """The line's fields for the interval ending ``now`` (None when idle); starts the next one."""
        then, prompt, generation = self._last
        self._last = (now, self._totals.prompt, self._totals.generation)
        elapsed = max(now - then, 1e-9)
        stats = self._stats()
        moved = self._totals.prompt != prompt or self._totals.generation != generation
        if not moved and stats.running == 0 and stats.waiting == 0:
            return None
        fields: dict[str, Any] = dict(
            prompt_tok_s=round((self._totals.prompt - prompt) / elapsed, 1),
            generation_tok_s=round((self._totals.generation - generation) / elapsed, 1),
            running=stats.running,
            waiting=stats.waiting,
            kv_used_pct=round(100 * stats.kv_pages_used / max(stats.kv_pages_total, 1), 1),
            slots=f"{stats.slots_used}/{stats.slots_total}",
        )
        cache = stats.prefix_cache
        if cache.queries:
            fields["prefix_hit_pct"] = round(100 * cache.hits / cache.queries, 1)
        return fields

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            fields = self.fields(time.monotonic())
            if fields is not None:
                log.info("stats", **fields)

    def __enter__(self) -> StatsLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
