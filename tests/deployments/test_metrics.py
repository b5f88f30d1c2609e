"""Every engine and router metric (docs/design.md: Metrics) on Ray's metrics endpoint, parsed with prometheus_client's
text parser; prefix-cache hit tokens grow after repeated prompts."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.deployments.metric_defs import CANARY_METRICS, ENGINE_METRICS, ROUTER_METRICS
from service.deployments.metrics import scraped_name
from tests.deployments.serve_testkit import wait_until


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
        samples = wait_until(complete_scrape, timeout_s=60, interval_s=1, what="all metrics")
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
        timeout_s=30,
        interval_s=1,
        what="hit-token counter to grow",
    )
