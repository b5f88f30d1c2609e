"""Every engine and router metric (docs/design.md: Metrics) on Ray's metrics endpoint, parsed with prometheus_client's
text parser; prefix-cache hit tokens grow after repeated prompts; the memory plan's gauges equal the plan."""

from __future__ import annotations

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families

from service.deployments.metric_defs import (
    CANARY_METRICS,
    ENGINE_METRICS,
    MEMORY_PLAN_PARTS,
    MEMORY_PLAN_POOLS,
    ROUTER_METRICS,
)
from service.deployments.metrics import _MEMORY_PLAN_STATS, RAY_EXPORT_PREFIX, EngineMetrics, scraped_name
from service.engine.runner.memory_plan import StateBytes, plan_memory
from tests.deployments.serve_testkit import METRICS_EXPORT_TIMEOUT_S, wait_until


def scrape(url: str) -> dict[str, list]:
    """sample name -> samples."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _expected_samples(defn) -> list[str]:
    name = scraped_name(defn)
    return [name + s for s in ("_bucket", "_count", "_sum")] if defn.kind == "histogram" else [name]


def _hit_tokens(samples: dict[str, list], app: str) -> float:
    name = scraped_name(next(m for m in ENGINE_METRICS if m.name.endswith("prefix_cache_hit_tokens_total")))
    return sum(s.value for s in samples.get(name, []) if s.labels.get("application") == app)


def _make_snapshot_miss(http) -> None:
    """A prompt sharing only the first 128 tokens of a cached 264-token prompt: KV matches 128 tokens, the only
    snapshot on that path sits at 256, so the lookup is a mamba snapshot miss."""
    first = list(range(30, 30 + 264))
    for prompt in (first, first[:128] + list(range(500, 572))):
        assert http.post("/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).status_code == 200


def test_every_engine_and_router_metric_is_exported(cluster, main_app, http, router_runs, canary_app):
    _make_snapshot_miss(http)
    assert (
        http.post("/completions", json={"model": "tiny", "prompt": "count", "max_tokens": 4}).status_code == 200
    )  # ITL
    # the mismatch counter only appears once a mismatch happens (Ray refuses inc(0)); checked below
    canary = [d for d in CANARY_METRICS if not d.name.endswith("canary_mismatches_total")]
    wanted = {s: d for d in ENGINE_METRICS + ROUTER_METRICS + tuple(canary) for s in _expected_samples(d)}

    checks_name = scraped_name(next(d for d in CANARY_METRICS if d.name.endswith("canary_checks_total")))

    def complete_scrape() -> dict[str, list] | None:
        got = scrape(cluster.metrics_url)
        kinds = {s.labels.get("kind") for s in got.get(checks_name, [])}
        return got if wanted.keys() <= got.keys() and kinds == {"pinned", "audit"} else None

    try:
        samples = wait_until(complete_scrape, timeout_s=METRICS_EXPORT_TIMEOUT_S, interval_s=1, what="all metrics")
    except AssertionError:
        got = scrape(cluster.metrics_url)
        raise AssertionError(
            f"missing {sorted(wanted.keys() - got.keys())}; hybrid_serve samples: "
            f"{sorted(k for k in got if 'hybrid' in k)}"
        ) from None
    for name, defn in wanted.items():
        for sample in samples[name]:
            assert set(defn.labels) <= set(sample.labels), (name, sample.labels)
            assert {"application", "deployment", "replica"} <= set(sample.labels), (name, sample.labels)
    kinds = {s.labels["kind"] for s in samples[scraped_name(next(d for d in ENGINE_METRICS if d.labels == ("kind",)))]}
    assert kinds == {"kv", "mamba"}
    phases = {s.labels["phase"]: s.value for s in samples["ray_hybrid_serve_engine_core_seconds_total"]}
    assert phases.keys() == {"host", "device_wait", "idle", "send", "gc"}, phases
    assert min(phases[p] for p in ("host", "device_wait", "idle", "send")) > 0 and phases["gc"] >= 0, phases
    reasons = {s.labels["reason"] for s in samples["ray_hybrid_serve_router_decisions_total"]}
    assert {"prefix", "miss"} <= reasons
    assert {s.labels["kind"] for s in samples[checks_name]} == {"pinned", "audit"}  # canary_app audits every request
    mismatches = samples.get("ray_hybrid_serve_canary_mismatches_total", [])
    assert sum(s.value for s in mismatches) == 0, mismatches
    assert all(s.value == 1.0 for s in samples["ray_hybrid_serve_canary_token_agreement_ratio"])


def test_hit_tokens_grow_after_repeated_prompts(cluster, main_app, http):
    before = _hit_tokens(scrape(cluster.metrics_url), main_app.name)
    prompt = list(range(40, 40 + 200))
    cached = 0
    for _ in range(3):
        resp = http.post("/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        cached += resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    wait_until(
        lambda: _hit_tokens(scrape(cluster.metrics_url), main_app.name) >= before + cached,
        timeout_s=METRICS_EXPORT_TIMEOUT_S,
        interval_s=1,
        what="hit-token counter to grow",
    )


@ray.remote(num_cpus=0)
class _ReplicaMetrics:
    """The engine replica's `EngineMetrics` in a Ray worker, fed an `engine.stats()` snapshot (CPU engines have no
    memory plan, so the plan comes from `plan_memory`'s arithmetic on an H200-sized device)."""

    def __init__(self) -> None:
        self.metrics = EngineMetrics()

    def export(self, stats: dict[str, float]) -> None:
        self.metrics.update_from_stats(stats)


def test_memory_plan_metrics_equal_the_plan(cluster):
    GiB = 1 << 30
    sizes = StateBytes(kv_page=6 * 2 * 64 * 2 * 128 * 1, mamba_slot=23 * (12288 * 3 * 2 + 64 * 64 * 128 * 4))
    plan = plan_memory(141 * GiB, 0.9, 32 * GiB, 5 * GiB + 123, 3 * GiB, sizes, 256, 8192, 64, 512, 1 << 20)
    assert {key for key, _, _ in _MEMORY_PLAN_STATS} == set(plan.stats()), "every plan field has its metric"
    actor = _ReplicaMetrics.remote()
    ray.get(actor.export.remote({**plan.stats(), "num_requests_running": 3}))
    by_label = {"hybrid_serve_memory_plan_bytes": "part", "hybrid_serve_memory_plan_pool_size": "pool"}

    def exported() -> dict[tuple[str, str], float] | None:
        got = {}
        for name, label in by_label.items():
            for s in scrape(cluster.metrics_url).get(RAY_EXPORT_PREFIX + name, []):
                if label in s.labels and "application" not in s.labels:
                    got[(name, s.labels[label])] = s.value
        return got if len(got) == len(_MEMORY_PLAN_STATS) else None

    got = wait_until(exported, timeout_s=METRICS_EXPORT_TIMEOUT_S, interval_s=1, what="memory plan metrics")
    want = {(name, value): float(plan.stats()[key]) for key, name, (_, value) in _MEMORY_PLAN_STATS}
    assert got == want
    assert {v for (n, v) in want if n.endswith("_bytes")} == set(MEMORY_PLAN_PARTS)
    assert {v for (n, v) in want if n.endswith("_pool_size")} == set(MEMORY_PLAN_POOLS)
    assert got[("hybrid_serve_memory_plan_pool_size", "kv_pages")] == plan.num_kv_pages > 0
    ray.kill(actor)
