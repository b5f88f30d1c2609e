"""The Grafana dashboard and the alert rules only query metrics that are exported, the dashboard
covers every registered metric, and the PodMonitors turn what Ray's metrics agent really exports
into the registry's names.

Oracles: promql-parser (Prometheus grammar), the metric registry in code, a real Ray metrics agent
and prometheus_client's text parser."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from service.deployments.metric_defs import ALL_METRICS, metric_names
from tests.helm.helm_chart_util import CONFIGS, REPO, load_values, only
from tests.helm.promql_names import RAY_SERVE_METRICS, check, grafana_query_names, selector_names

REQUIRED_ALERTS = {
    "HybridServeCanaryMismatch",
    "HybridServeCanaryAnswerAccuracyDrop",
    "HybridServePrefixHitsFlat",
    "HybridServeTTFTHigh",
    "HybridServeKVCacheFull",
    "HybridServeMambaCacheFull",
    "HybridServeReplicaUnhealthy",
    "HybridServeRayServiceNotReady",
}


def dashboard(objects: list[dict]) -> dict:
    configmap = only(objects, "ConfigMap", "-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = configmap["data"].values()
    return json.loads(text)


def panel_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def alert_rules(objects: list[dict]) -> list[dict]:
    rule = only(objects, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_dashboard_queries_use_exported_metrics_and_cover_the_registry(manifests):
    dash = dashboard(manifests("default"))
    exprs = panel_exprs(dash)
    checks = [check(e, grafana=True) for e in exprs]
    checks += [check(v["query"]["query"], grafana=True) for v in dash["templating"]["list"] if v["type"] == "query"]
    unknown = {c.expr: sorted(c.unknown) for c in checks if c.unknown}
    assert not unknown, f"queries use metrics nobody exports: {unknown}"
    used = set().union(*(c.names for c in checks))
    for metric in ALL_METRICS:
        series = {metric.name} | (
            {metric.name + s for s in ("_bucket", "_sum", "_count")} if metric.kind == "histogram" else set()
        )
        assert used & series, f"no dashboard panel shows {metric.name}"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert all("$namespace" in e and "$rayservice" in e for e in exprs), "every query selects the release"


@pytest.mark.parametrize("config", CONFIGS)
def test_alert_expressions_reference_exported_metrics(manifests, config):
    rules = alert_rules(manifests(config))
    values = load_values(config)
    names = {r["alert"] for r in rules}
    expected = set(REQUIRED_ALERTS)
    if values["engine"]["mambaCacheStrategy"] == "off":
        expected.discard("HybridServePrefixHitsFlat")
    if not values["canary"]["enabled"]:
        expected -= {"HybridServeCanaryMismatch", "HybridServeCanaryAnswerAccuracyDrop"}
    assert expected <= names, f"missing alerts {expected - names}"
    for rule in rules:
        result = check(rule["expr"])
        assert not result.unknown, f"{rule['alert']} uses unknown metrics {sorted(result.unknown)}"
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
        if "for" in rule:
            assert re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", rule["for"])
        if not {"kuberay_service_condition_ready"} & result.names:
            assert 'namespace="llm"' in rule["expr"] and 'rayservice="hs-hybrid-serve"' in rule["expr"]


def test_alerts_follow_cache_and_canary_settings(manifests):
    names = {
        r["alert"]
        for r in alert_rules(
            manifests("default", "--set", "engine.mambaCacheStrategy=off", "--set", "canary.enabled=false")
        )
    }
    assert not {"HybridServePrefixHitsFlat", "HybridServeCanaryMismatch", "HybridServeCanaryAnswerAccuracyDrop"} & names
    assert "HybridServeTTFTHigh" in names


@pytest.mark.parametrize(
    "expr,reason",
    [
        ("rate(hybrid_serve_bogus_tokens_total[5m])", "unknown"),
        ('sum by (le) (rate(hybrid_serve_time_to_first_token_bucket{pod="a"}[5m]))', "unknown"),  # missing _seconds
        ('{__name__=~"hybrid_serve_.+"}', "not literal"),
        ("sum(rate(hybrid_serve_prompt_tokens_total[5m])", "syntax"),
    ],
)
def test_the_name_check_rejects_bad_expressions(expr, reason):
    """Negative control: an unknown name, a regex name and a syntax error are all caught."""
    if reason == "unknown":
        assert check(expr).unknown
    else:
        with pytest.raises(ValueError):
            selector_names(expr)


def test_the_name_check_sees_every_selector():
    names = grafana_query_names(
        "histogram_quantile(0.99, sum by (le) (rate(hybrid_serve_e2e_request_latency_seconds_bucket[$__rate_interval])))"
        ' / on() group_left() max(ray_serve_deployment_status offset 5m) and {__name__="hybrid_serve_prompt_tokens_total"}'
    )
    assert names == {
        "hybrid_serve_e2e_request_latency_seconds_bucket",
        "ray_serve_deployment_status",
        "hybrid_serve_prompt_tokens_total",
    }
    assert grafana_query_names('label_values(hybrid_serve_num_requests_running{namespace="x"}, rayservice)') == {
        "hybrid_serve_num_requests_running"
    }
    assert not (metric_names() & {"le", "rayservice", "namespace"})


def test_external_ray_metrics_are_declared_by_ray():
    """The allow-listed ray_serve_* names are Ray Serve's own metrics in the installed Ray."""
    sources = "\n".join(p.read_text() for p in (Path(ray.__file__).parent / "serve" / "_private").glob("*.py"))
    for exported, declared in RAY_SERVE_METRICS.items():
        assert exported == "ray_" + declared
        assert f'"{declared}"' in sources, f"Ray {ray.__version__} does not declare {declared}"


# Registers every registry metric in a Ray actor and dumps the local metrics agent's /metrics text.
_RAY_EXPORT_SCRIPT = r"""
import sys, time, urllib.request
import ray
from ray.util import metrics
port, out_path, defs = int(sys.argv[1]), sys.argv[2], eval(sys.argv[3])
ray.init(address="local", num_cpus=1, include_dashboard=False, _metrics_export_port=port, log_to_driver=False)

@ray.remote(num_cpus=0)
class Exporter:
    def __init__(self, defs):
        self.live = []
        for name, kind, labels in defs:
            tags, keys = {k: "x" for k in labels} or None, tuple(labels) or None
            if kind == "counter":
                m = metrics.Counter(name, description=name, tag_keys=keys); m.inc(1, tags=tags)
            elif kind == "gauge":
                m = metrics.Gauge(name, description=name, tag_keys=keys); m.set(0.5, tags=tags)
            else:
                m = metrics.Histogram(name, description=name, boundaries=[0.1, 1.0], tag_keys=keys); m.observe(0.3, tags=tags)
            self.live.append(m)

    def ready(self):
        return True

exporter = Exporter.remote(defs)
ray.get(exporter.ready.remote())
deadline, text = time.time() + 60, ""
while time.time() < deadline and not all("ray_" + name in text for name, _, _ in defs):
    time.sleep(0.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
open(out_path, "w").write(text)
ray.shutdown()
"""


def prometheus_relabel(name: str, rules: list[dict]) -> str:
    """Prometheus `replace` relabelling of the __name__ label (regex anchored, $N groups)."""
    for rule in rules:
        assert (
            rule["action"] == "replace" and rule["sourceLabels"] == ["__name__"] and rule["targetLabel"] == "__name__"
        )
        match = re.fullmatch(rule["regex"], name)
        if match:
            name = match.expand(re.sub(r"\$(\d+)", r"\\\1", rule["replacement"]))
    return name


@pytest.mark.timeout(120)
def test_podmonitor_maps_rays_exported_names_to_the_registry(manifests, tmp_path):
    """Ray's metrics agent exports a metric NAME as ray_NAME; the PodMonitors' metricRelabelings
    give Prometheus exactly the registry names the dashboard and alerts query."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "metrics.txt"
    defs = repr([(m.name, m.kind, m.labels) for m in ALL_METRICS])
    env = {**os.environ, "RAY_metrics_report_interval_ms": "500", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _RAY_EXPORT_SCRIPT, str(port), str(out), defs],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    scraped = {s.name for family in text_string_to_metric_families(out.read_text()) for s in family.samples}
    assert not (metric_names() & scraped), "Ray no longer prefixes application metrics: drop the relabelling"
    sample_names = {m.name for m in ALL_METRICS if m.kind != "histogram"} | {
        m.name + suffix for m in ALL_METRICS if m.kind == "histogram" for suffix in ("_bucket", "_sum", "_count")
    }
    monitors = [o for o in manifests("default") if o["kind"] == "PodMonitor"]
    for monitor in monitors:
        rules = monitor["spec"]["podMetricsEndpoints"][0]["metricRelabelings"]
        stored = {prometheus_relabel(name, rules) for name in scraped}
        assert sample_names <= stored, f"not stored under registry names: {sorted(sample_names - stored)}"
        ray_internal = {n for n in scraped if n.startswith("ray_") and "hybrid_serve" not in n}
        assert ray_internal and ray_internal <= stored, "Ray's own metrics must keep their names"
