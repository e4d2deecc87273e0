"""The prefix cache in /metrics and on the stats line: its counters move as requests hit, through
the server and engine over the test double of the ranks."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from phalanx.engine.engine import Engine, EngineStats, PrefixCacheStats
from phalanx.executor.model_info import ModelInfo
from phalanx.protocol.messages import Capacity
from phalanx.server.app import create_app
from phalanx.server.metrics import ServerMetrics, TokenTotals
from phalanx.server.stats_log import StatsLog
from tests.support.fake_ranks import FakeRanks

PREFIX_METRICS = {
    "phalanx_prefix_cache_queries_total",
    "phalanx_prefix_cache_hits_total",
    "phalanx_prefix_cache_hit_tokens_total",
    "phalanx_prefix_cache_evictions_total",
    "phalanx_prefix_cache_cached_pages",
}


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def engine_stats(cache: PrefixCacheStats) -> EngineStats:
    return EngineStats(1, 0, 10, 100, 1, 4, steps=3, last_step_seconds=0.0, prefix_cache=cache)


def test_prefix_cache_metrics_are_exported_with_their_values() -> None:
    cache = PrefixCacheStats(
        queries=9, hits=4, hit_tokens=640, evicted_pages=7, evicted_snapshots=2, cached_pages=33
    )
    metrics = ServerMetrics(lambda: engine_stats(cache), lambda: False, lambda: 0)
    found = samples(metrics.render().decode())
    assert {name for name, _ in found} >= PREFIX_METRICS
    assert found["phalanx_prefix_cache_queries_total", ()] == 9
    assert found["phalanx_prefix_cache_hits_total", ()] == 4
    assert found["phalanx_prefix_cache_hit_tokens_total", ()] == 640
    assert found["phalanx_prefix_cache_evictions_total", (("kind", "page"),)] == 7
    assert found["phalanx_prefix_cache_evictions_total", (("kind", "snapshot"),)] == 2
    assert found["phalanx_prefix_cache_cached_pages", ()] == 33


def test_the_stats_line_shows_the_hit_rate_once_the_cache_was_queried() -> None:
    stats = [engine_stats(PrefixCacheStats())]
    reporter = StatsLog(lambda: stats[0], TokenTotals(), interval_s=5.0)
    assert "prefix_hit_pct" not in reporter.fields(1.0)  # cache off, or nothing looked up yet
    stats[0] = engine_stats(PrefixCacheStats(queries=8, hits=3))
    assert reporter.fields(2.0)["prefix_hit_pct"] == 37.5


class CachingRanks(FakeRanks):
    def __init__(self) -> None:
        super().__init__(Capacity(64, 16, 4, 64, snapshot_slots=4), vocab=384)
        self.model_info = ModelInfo(
            vocab_size=512, eos_token_ids=(2,), max_position_embeddings=1024, model_type="fake"
        )
        self.poison_reason: str | None = None

    def shutdown(self) -> bool:
        return True


def test_a_repeated_prompt_hits_and_metrics_count_it(tiny_model_dir: Path) -> None:
    engine = Engine(CachingRanks(), tiny_model_dir, prefix_snapshot_interval=16)
    prompt = list(range(3, 40))  # 37 tokens: snapshots at 16 and 32
    try:
        with TestClient(create_app(engine, tiny_model_dir, "tiny")) as http:
            body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
            first = http.post("/v1/completions", json=body).json()
            again = http.post("/v1/completions", json=body).json()
            assert first["choices"][0]["text"] == again["choices"][0]["text"]
            found = samples(http.get("/metrics").text)
    finally:
        engine.shutdown()
    assert found["phalanx_prefix_cache_queries_total", ()] == 2
    assert found["phalanx_prefix_cache_hits_total", ()] == 1
    assert found["phalanx_prefix_cache_hit_tokens_total", ()] == 32
    assert found["phalanx_prefix_cache_cached_pages", ()] == 2
    assert found["phalanx_kv_pages_used", ()] == 0
