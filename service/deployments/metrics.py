"""Live Prometheus metrics, created from the registry in `metric_defs` (docs/design.md: Metrics).

They are Ray Serve metrics (`ray.serve.metrics`), so they carry the replica's `deployment`, `replica`
and `application` labels and leave the process through Ray's metrics agent. The agent prefixes
every application metric with `ray_` (its Prometheus namespace, fixed in Ray 2.60) and, because
our counter names already end in `_total`, adds no second suffix: a metric defined as
`hybrid_serve_x_total` is scraped as `ray_hybrid_serve_x_total` (`scraped_name`). Ray records a
histogram observation at its bucket's midpoint, so `_sum` is approximate; buckets and counts are exact.
Ray refuses to increment a counter by 0, so a counter's series appears with its first event (e.g.
`cache_evictions_total{kind="mamba"}` after the first mamba eviction).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.serve import metrics as serve_metrics

from service.deployments.counter_batch import CounterBatch
from service.deployments.metric_defs import (
    CANARY_METRICS,
    ENGINE_METRICS,
    MEMORY_PLAN_METRICS,
    ROUTER_METRICS,
    MetricDef,
)

RAY_EXPORT_PREFIX = "ray_"  # Ray's metrics agent namespace, prepended to every application metric

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
_BUCKETS: Mapping[str, tuple[float, ...]] = {
    "hybrid_serve_time_to_first_token_seconds": _LATENCY_BUCKETS_S,
    "hybrid_serve_inter_token_latency_seconds": (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    "hybrid_serve_e2e_request_latency_seconds": _LATENCY_BUCKETS_S,
    "hybrid_serve_router_predicted_hit_ratio": _RATIO_BUCKETS,
}

# engine.stats() key -> (metric name, label values); counters are fed deltas of these cumulative stats
_COUNTER_STATS: tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...] = (
    ("prefix_cache_queried_tokens", "hybrid_serve_prefix_cache_queried_tokens_total", ()),
    ("prefix_cache_hit_tokens", "hybrid_serve_prefix_cache_hit_tokens_total", ()),
    ("mamba_snapshot_hits", "hybrid_serve_mamba_snapshot_hits_total", ()),
    ("mamba_snapshot_misses", "hybrid_serve_mamba_snapshot_misses_total", ()),
    ("cache_evictions_kv", "hybrid_serve_cache_evictions_total", (("kind", "kv"),)),
    ("cache_evictions_mamba", "hybrid_serve_cache_evictions_total", (("kind", "mamba"),)),
    ("prompt_tokens", "hybrid_serve_prompt_tokens_total", ()),
    ("generation_tokens", "hybrid_serve_generation_tokens_total", ()),
    ("core_host_seconds", "hybrid_serve_engine_core_seconds_total", (("phase", "host"),)),
    ("core_device_wait_seconds", "hybrid_serve_engine_core_seconds_total", (("phase", "device_wait"),)),
    ("core_idle_seconds", "hybrid_serve_engine_core_seconds_total", (("phase", "idle"),)),
    ("core_send_seconds", "hybrid_serve_engine_core_seconds_total", (("phase", "send"),)),
    ("core_gc_seconds", "hybrid_serve_engine_core_seconds_total", (("phase", "gc"),)),
    ("core_steps", "hybrid_serve_engine_core_steps_total", ()),
)
_GAUGE_STATS: tuple[tuple[str, str], ...] = (
    ("kv_cache_usage_ratio", "hybrid_serve_kv_cache_usage_ratio"),
    ("mamba_cache_usage_ratio", "hybrid_serve_mamba_cache_usage_ratio"),
    ("num_requests_running", "hybrid_serve_num_requests_running"),
    ("num_requests_waiting", "hybrid_serve_num_requests_waiting"),
)

# engine.stats() key (`MemoryPlan.stats()`) -> (metric name, label); exported only when the engine has a plan
_MEMORY_PLAN_STATS: tuple[tuple[str, str, tuple[str, str]], ...] = (
    ("memory_plan_total_bytes", "hybrid_serve_memory_plan_bytes", ("part", "total")),
    ("memory_plan_budget_bytes", "hybrid_serve_memory_plan_bytes", ("part", "budget")),
    ("memory_plan_weights_bytes", "hybrid_serve_memory_plan_bytes", ("part", "weights")),
    ("memory_plan_activation_bytes", "hybrid_serve_memory_plan_bytes", ("part", "activations")),
    ("memory_plan_graph_bytes", "hybrid_serve_memory_plan_bytes", ("part", "cuda_graphs")),
    ("memory_plan_kv_bytes", "hybrid_serve_memory_plan_bytes", ("part", "kv")),
    ("memory_plan_mamba_live_bytes", "hybrid_serve_memory_plan_bytes", ("part", "mamba_live")),
    ("memory_plan_mamba_snapshot_bytes", "hybrid_serve_memory_plan_bytes", ("part", "mamba_snapshot")),
    ("memory_plan_free_bytes", "hybrid_serve_memory_plan_bytes", ("part", "free")),
    ("memory_plan_num_kv_pages", "hybrid_serve_memory_plan_pool_size", ("pool", "kv_pages")),
    ("memory_plan_num_live_slots", "hybrid_serve_memory_plan_pool_size", ("pool", "mamba_live_slots")),
    ("memory_plan_num_snapshot_slots", "hybrid_serve_memory_plan_pool_size", ("pool", "mamba_snapshot_slots")),
)


def scraped_name(defn: MetricDef) -> str:
    """The sample name (histograms: the family name) as it appears on Ray's metrics endpoint."""
    return RAY_EXPORT_PREFIX + defn.name


def make_metric(defn: MetricDef) -> Any:
    """One live Ray Serve metric for `defn` (name, help and label keys taken from the registry)."""
    tag_keys = defn.labels or None
    if defn.kind == "counter":
        return serve_metrics.Counter(defn.name, description=defn.help, tag_keys=tag_keys)
    if defn.kind == "gauge":
        return serve_metrics.Gauge(defn.name, description=defn.help, tag_keys=tag_keys)
    return serve_metrics.Histogram(
        defn.name,
        description=defn.help,
        boundaries=list(_BUCKETS.get(defn.name, _LATENCY_BUCKETS_S)),
        tag_keys=tag_keys,
    )


@dataclass
class EngineMetrics:
    """The engine replica's metrics: engine counters/gauges polled from `engine.stats()` and
    per-request timings observed by the deployment."""

    live: dict[str, Any] = field(
        default_factory=lambda: {d.name: make_metric(d) for d in ENGINE_METRICS + MEMORY_PLAN_METRICS}
    )
    last_counts: dict[str, float] = field(default_factory=dict)  # stats key -> last cumulative value exported

    def update_from_stats(self, stats: Mapping[str, Any]) -> None:
        """Export one `engine.stats()` snapshot: counter deltas since the last one, gauges as is."""
        for key, name, labels in _COUNTER_STATS:
            value = float(stats.get(key, 0))
            delta = value - self.last_counts.get(key, 0.0)
            if delta < 0:  # the engine restarted its counters: count from zero again
                delta = value
            if delta > 0:
                self.live[name].inc(delta, tags=dict(labels) or None)
            self.last_counts[key] = value
        for key, name in _GAUGE_STATS:
            self.live[name].set(float(stats.get(key, 0.0)))
        for key, name, (label, value) in _MEMORY_PLAN_STATS:
            if key in stats:
                self.live[name].set(float(stats[key]), tags={label: value})

    def record_group(self, requests: int) -> None:
        """One grouped call received, carrying `requests` requests."""
        self.live["hybrid_serve_group_calls_total"].inc()
        if requests:
            self.live["hybrid_serve_group_requests_total"].inc(requests)

    def observe_request(self, ttft_s: float | None, itl_s: list[float], e2e_s: float) -> None:
        """Timings of one finished (or aborted) request, in seconds."""
        if ttft_s is not None and math.isfinite(ttft_s):
            self.live["hybrid_serve_time_to_first_token_seconds"].observe(ttft_s)
        for gap in itl_s:
            self.live["hybrid_serve_inter_token_latency_seconds"].observe(gap)
        self.live["hybrid_serve_e2e_request_latency_seconds"].observe(e2e_s)


@dataclass
class RouterMetrics:
    """The prefix-aware router's metrics (live in the process that holds the engine handle)."""

    live: dict[str, Any] = field(default_factory=lambda: {d.name: make_metric(d) for d in ROUTER_METRICS})
    counts: CounterBatch = field(init=False)  # the decision counter, batched (one decision per request)

    def __post_init__(self) -> None:
        self.counts = CounterBatch(self.live)

    def record_decision(self, reason: str, predicted_hit_ratio: float) -> None:
        self.counts.inc("hybrid_serve_router_decisions_total", 1, (("reason", reason),))
        self.live["hybrid_serve_router_predicted_hit_ratio"].observe(predicted_hit_ratio)


@dataclass
class CanaryMetrics:
    """The accuracy canary's metrics (per engine replica)."""

    live: dict[str, Any] = field(default_factory=lambda: {d.name: make_metric(d) for d in CANARY_METRICS})

    def record(self, kind: str, mismatch: bool, max_state_rel_error: float, token_agreement: float) -> None:
        tags = {"kind": kind}
        self.live["hybrid_serve_canary_checks_total"].inc(1, tags=tags)
        if mismatch:
            self.live["hybrid_serve_canary_mismatches_total"].inc(1, tags=tags)
        if math.isfinite(max_state_rel_error):
            self.live["hybrid_serve_canary_max_state_rel_error"].set(max_state_rel_error)
        self.live["hybrid_serve_canary_token_agreement_ratio"].set(token_agreement)

    def record_answers(self, correct: int, asked: int) -> None:
        """One canary round over pinned questions with known answers (nothing to record when none was asked)."""
        if asked:
            self.live["hybrid_serve_canary_answer_accuracy"].set(correct / asked)
