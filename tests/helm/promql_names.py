"""Metric names used by PromQL expressions, read with a real PromQL parser (promql-parser, a port of
Prometheus' grammar), and the check that every one is a metric somebody exports."""

from __future__ import annotations

import re
from dataclasses import dataclass

import promql_parser

from service.deployments.metric_defs import metric_names

# Grafana macros are not PromQL; they stand for durations.
GRAFANA_DURATION_MACROS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$", re.S)

# Metrics outside our registry that the chart uses on purpose, each with its exporter. The Ray names
# are Ray Serve's own controller gauges (the metrics agent exports Ray's metric NAME as ray_NAME);
# test_external_ray_metrics_are_declared_by_ray checks the installed Ray declares them.
RAY_SERVE_METRICS = {
    "ray_serve_deployment_status": "serve_deployment_status",  # 0..6, 6 = HEALTHY
    "ray_serve_deployment_replica_healthy": "serve_deployment_replica_healthy",
}
# The KubeRay operator's RayService Ready condition (ray-operator metrics, KubeRay >= 1.3): the only
# signal for "RayService not ready", which no pod of the RayService can report about itself.
KUBERAY_METRICS = {"kuberay_service_condition_ready"}


@dataclass(frozen=True)
class NameCheck:
    expr: str  # the expression as written
    names: frozenset[str]  # metric names it selects
    unknown: frozenset[str]  # names neither in the registry nor in the allow-lists


def selector_names(expr: str) -> frozenset[str]:
    """Metric names of every vector selector in `expr` (Grafana macros allowed).

    Raises ValueError on a syntax error or on a selector whose name is not a literal
    (`{__name__=~"..."}`), since such a selector cannot be checked against the registry."""
    for macro, duration in GRAFANA_DURATION_MACROS.items():
        expr = expr.replace(macro, duration)
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(_literal_name(node))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    if not names:
        raise ValueError(f"no metric in {expr!r}")
    return frozenset(names)


def _literal_name(selector: promql_parser.VectorSelector) -> str:
    if selector.name:
        return selector.name
    for matcher in selector.matchers.matchers:
        if matcher.name == "__name__" and matcher.op == promql_parser.MatchOp.Equal:
            return matcher.value
    raise ValueError(f"selector without a literal metric name: {selector}")


def grafana_query_names(query: str) -> frozenset[str]:
    """Names in a Grafana Prometheus query: PromQL, or a `label_values(selector, label)` variable."""
    match = LABEL_VALUES.match(query)
    return selector_names(match.group("selector") if match else query)


def check(expr: str, grafana: bool = False) -> NameCheck:
    names = grafana_query_names(expr) if grafana else selector_names(expr)
    known = metric_names() | set(RAY_SERVE_METRICS) | KUBERAY_METRICS
    return NameCheck(expr, names, frozenset(names - known))
