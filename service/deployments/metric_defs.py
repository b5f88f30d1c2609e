"""The registry of every Prometheus metric the service exports (docs/design.md: Metrics).

Pure data: the deployments create the live metrics from it, the Helm chart's dashboard and alert
tests check their queries against it. Names are the Prometheus names as stored: Ray's metrics agent
exports application metrics as `ray_<name>`, and the chart's PodMonitors strip that prefix, so
Prometheus (and the dashboard and alerts) see exactly these names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MetricDef:
    name: str  # Prometheus name as scraped
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()  # besides the per-replica labels Ray adds
    source: Literal["engine", "router", "canary", "ingress"] = "engine"


_P = "hybrid_serve_"
ENGINE_METRICS: tuple[MetricDef, ...] = (
    MetricDef(_P + "prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache"),
    MetricDef(_P + "prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache"),
    MetricDef(_P + "mamba_snapshot_hits_total", "counter", "Prefix hits that resumed from a mamba snapshot"),
    MetricDef(
        _P + "mamba_snapshot_misses_total", "counter", "Lookups where KV matched deeper than the deepest mamba snapshot"
    ),
    MetricDef(_P + "cache_evictions_total", "counter", "Prefix-cache evictions", ("kind",)),
    MetricDef(_P + "kv_cache_usage_ratio", "gauge", "Fraction of KV pages in use"),
    MetricDef(_P + "mamba_cache_usage_ratio", "gauge", "Fraction of mamba state slots in use"),
    MetricDef(_P + "num_requests_running", "gauge", "Requests in the running batch"),
    MetricDef(_P + "num_requests_waiting", "gauge", "Requests waiting for admission"),
    MetricDef(_P + "time_to_first_token_seconds", "histogram", "Time to first token"),
    MetricDef(
        _P + "inter_token_latency_seconds",
        "histogram",
        "Time between consecutive output tokens (one observation per streamed chunk: its gap over its tokens)",
    ),
    MetricDef(_P + "e2e_request_latency_seconds", "histogram", "End-to-end request latency"),
    MetricDef(_P + "prompt_tokens_total", "counter", "Prompt tokens processed"),
    MetricDef(_P + "generation_tokens_total", "counter", "Tokens generated"),
    MetricDef(_P + "group_calls_total", "counter", "Grouped Serve calls (several requests per call) received"),
    MetricDef(_P + "group_requests_total", "counter", "Requests the grouped Serve calls carried into this replica"),
    MetricDef(
        _P + "engine_core_seconds_total",
        "counter",
        "Wall seconds of the engine core process by phase: host (in Engine.step, not waiting for the device), "
        "device_wait (in Engine.step, waiting for a step's results), idle (no request to step), send (its sender "
        "thread making and writing output messages, waits on the pipe included; overlaps the others), gc (in Python's "
        "garbage collector; part of the others)",
        ("phase",),
    ),
    MetricDef(_P + "engine_core_steps_total", "counter", "Engine steps run by the engine core process"),
)
# the engine's memory plan (runner/memory_plan.py; engines on CUDA that size their pools from it, none on CPU)
MEMORY_PLAN_PARTS = (  # `part` label values: the plan's bytes
    "total",  # the device's memory
    "budget",  # total * gpu_memory_utilization
    "weights",
    "activations",  # peak of the profiling forward at the token budget
    "cuda_graphs",  # reserve for the decode CUDA graphs
    "kv",  # KV pages
    "mamba_live",  # Mamba live slots (one per running request)
    "mamba_snapshot",  # Mamba snapshot slots of the prefix cache
    "free",  # budget left unplanned
)
MEMORY_PLAN_POOLS = ("kv_pages", "mamba_live_slots", "mamba_snapshot_slots")  # `pool` label values
MEMORY_PLAN_METRICS: tuple[MetricDef, ...] = (
    MetricDef(_P + "memory_plan_bytes", "gauge", "The engine's GPU memory plan in bytes, by part", ("part",)),
    MetricDef(_P + "memory_plan_pool_size", "gauge", "Pool sizes the memory plan gives, by pool", ("pool",)),
)
ROUTER_METRICS: tuple[MetricDef, ...] = (
    MetricDef(_P + "router_decisions_total", "counter", "Routing decisions by reason", ("reason",), "router"),
    MetricDef(
        _P + "router_predicted_hit_ratio",
        "histogram",
        "Predicted prefix-hit fraction of the chosen replica",
        (),
        "router",
    ),
)
CANARY_METRICS: tuple[MetricDef, ...] = (
    MetricDef(_P + "canary_checks_total", "counter", "Accuracy canary checks run", ("kind",), "canary"),
    MetricDef(
        _P + "canary_mismatches_total",
        "counter",
        "Canary checks where cached and cold results differ",
        ("kind",),
        "canary",
    ),
    MetricDef(
        _P + "canary_max_state_rel_error", "gauge", "Largest relative state error of the last canary run", (), "canary"
    ),
    MetricDef(
        _P + "canary_token_agreement_ratio",
        "gauge",
        "Fraction of greedy tokens equal between cached and cold runs",
        (),
        "canary",
    ),
    MetricDef(
        _P + "canary_answer_accuracy",
        "gauge",
        "Fraction of the pinned questions the last canary round answered correctly (cached runs)",
        (),
        "canary",
    ),
)
INGRESS_METRICS: tuple[MetricDef, ...] = (  # `key`: the API key's id (a hash prefix), never the key
    MetricDef(
        _P + "api_requests_total",
        "counter",
        "OpenAI API requests by key id and HTTP status",
        ("key", "status"),
        "ingress",
    ),
    MetricDef(
        _P + "api_limit_refusals_total",
        "counter",
        "Requests refused by a per-key limit or per-request cap",
        ("key", "limit"),
        "ingress",
    ),
    MetricDef(_P + "api_tokens_total", "counter", "Tokens used (prompt + generated) by key id", ("key",), "ingress"),
)
ALL_METRICS: tuple[MetricDef, ...] = (
    ENGINE_METRICS + MEMORY_PLAN_METRICS + ROUTER_METRICS + CANARY_METRICS + INGRESS_METRICS
)


def metric_names() -> frozenset[str]:
    """Every name a scrape can contain (histograms add _bucket/_sum/_count)."""
    names: set[str] = set()
    for m in ALL_METRICS:
        names.add(m.name)
        if m.kind == "histogram":
            names.update({m.name + "_bucket", m.name + "_sum", m.name + "_count"})
    return frozenset(names)
