"""The stats line's arithmetic: throughput over the interval, occupancy from the engine, and no
line for an idle interval."""

from __future__ import annotations

import pytest

from phalanx.engine.engine import EngineStats
from phalanx.server.metrics import TokenTotals
from phalanx.server.stats_log import StatsLog


def _stats(running: int = 0, waiting: int = 0, kv_used: int = 0, slots_used: int = 0) -> EngineStats:
    return EngineStats(running, waiting, kv_used, 400, slots_used, 16, steps=0, last_step_seconds=0.0)


def test_a_busy_interval_gives_rates_and_occupancy_and_an_idle_one_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    totals = TokenTotals()
    now = [100.0]
    engine = [_stats()]
    monkeypatch.setattr("phalanx.server.stats_log.time.monotonic", lambda: now[0])
    reporter = StatsLog(lambda: engine[0], totals, interval_s=5.0)
    assert reporter.fields(105.0) is None  # nothing open, nothing moved

    totals.prompt, totals.generation = 1000, 250
    engine[0] = _stats(running=3, waiting=1, kv_used=100, slots_used=3)
    assert reporter.fields(110.0) == {
        "prompt_tok_s": 200.0,
        "generation_tok_s": 50.0,
        "running": 3,
        "waiting": 1,
        "kv_used_pct": 25.0,
        "slots": "3/16",
    }
    totals.generation = 260  # the burst ends within the interval: one last line, then silence
    engine[0] = _stats()
    assert reporter.fields(112.0)["generation_tok_s"] == 5.0
    assert reporter.fields(117.0) is None
    engine[0] = _stats(waiting=2)  # queued work with no token yet still counts as busy
    assert reporter.fields(122.0)["waiting"] == 2


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="the stats interval must be positive, got 0"):
        StatsLog(_stats, TokenTotals(), 0)
