"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own per app.

Token counters move as tokens arrive (a request's prompt once its first token is out), so the
periodic stats line can read throughput from them; request counts and latency histograms are
recorded as requests finish; the engine's occupancy
(running, waiting, KV pages, slots, steps, last step latency) and its prefix cache's counters are
read from ``engine.stats()`` at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from phalanx.engine.engine import EngineStats, PrefixCacheStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        poisoned: Callable[[], bool],
        rejected_frames: Callable[[], int],
    ) -> None:
        self._stats = stats
        self._poisoned = poisoned
        self._rejected_frames = rejected_frames

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "phalanx_requests_running": ("requests holding a slot or prefilling", s.running),
            "phalanx_requests_waiting": ("requests queued for admission", s.waiting),
            "phalanx_kv_pages_used": ("KV cache pages in use", s.kv_pages_used),
            "phalanx_kv_pages_total": ("KV cache pages", s.kv_pages_total),
            "phalanx_slots_used": ("decode slots in use", s.slots_used),
            "phalanx_slots_total": ("decode slots", s.slots_total),
            "phalanx_last_step_seconds": ("latency of the last engine step", s.last_step_seconds),
            "phalanx_engine_poisoned": ("1 once the engine is poisoned", int(self._poisoned())),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("phalanx_engine_steps", "engine steps run", value=s.steps)
        yield from _prefix_cache_metrics(s.prefix_cache)
        yield CounterMetricFamily(
            "phalanx_rejected_frames",
            "control frames the coordinator dropped (forged, undecodable, foreign, from no rank)",
            value=self._rejected_frames(),
        )


def _prefix_cache_metrics(cache: PrefixCacheStats) -> Iterator[Metric]:
    counters = {
        "phalanx_prefix_cache_queries": ("admitted requests looked up in the prefix cache", cache.queries),
        "phalanx_prefix_cache_hits": ("admitted requests that restored a cached prefix", cache.hits),
        "phalanx_prefix_cache_hit_tokens": ("prompt tokens restored instead of prefilled", cache.hit_tokens),
    }
    for name, (doc, value) in counters.items():
        yield CounterMetricFamily(name, doc, value=value)
    evictions = CounterMetricFamily(
        "phalanx_prefix_cache_evictions", "prefix cache entries evicted for room", labels=["kind"]
    )
    evictions.add_metric(["page"], cache.evicted_pages)
    evictions.add_metric(["snapshot"], cache.evicted_snapshots)
    yield evictions
    yield GaugeMetricFamily(
        "phalanx_prefix_cache_cached_pages", "KV pages the prefix cache holds", value=cache.cached_pages
    )


@dataclass
class TokenTotals:
    """Tokens processed since the server started, as plain numbers for the stats line."""

    prompt: int = 0
    generation: int = 0


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        poisoned: Callable[[], bool],
        rejected_frames: Callable[[], int],
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "phalanx_requests", "finished requests by outcome", ["outcome"], registry=self.registry
        )
        self.rejected = Counter("phalanx_requests_rejected", "requests answered 4xx", registry=self.registry)
        self.ttft = Histogram(
            "phalanx_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "phalanx_time_per_output_token_seconds",
            "mean time between tokens after the first, per request",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("phalanx_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter(
            "phalanx_generation_tokens", "generated tokens", registry=self.registry
        )
        self.registry.register(_EngineCollector(stats, poisoned, rejected_frames))
        self.totals = TokenTotals()

    def token(self, prompt_tokens: int = 0) -> None:
        """One generated token; the first of a request also brings its ``prompt_tokens``."""
        self.totals.generation += 1
        self.generation_tokens.inc()
        self.prompt(prompt_tokens)

    def prompt(self, prompt_tokens: int) -> None:
        """Prompt tokens run: with a request's first token, or when it ends having generated none."""
        self.totals.prompt += prompt_tokens
        self.prompt_tokens.inc(prompt_tokens)

    def finished(self, outcome: str, ttft: float | None = None, tpot: float | None = None) -> None:
        self.requests.labels(outcome=outcome).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
