"""One local Ray cluster (127.0.0.1) and one Serve instance for the tests of this package; both stop after its
last test, so the rest of the suite does not share the cores with idle replicas.

Apps are deployed under their own route prefix (`/<name>/v1`). `main_app` is the shared app most tests
use (2 engine replicas, both parsers, grouped engine calls); the router experiment deploys two small-cache apps once and
keeps them until the end of the package (the metrics test reads their eviction counters). Every other app
belongs to the test module that deployed it and is deleted when that module ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import serve

from loadtests.workloads import shared_prefix_workload
from service.deployments.app import build_app
from service.testing.tiny import make_tiny_model
from tests.deployments.serve_testkit import (
    ROUTER_CACHE_ARGS,
    ROUTER_GROUPS,
    ROUTER_PER_GROUP,
    ROUTER_PREFIX_TOKENS,
    ROUTER_SUFFIX_TOKENS,
    free_port,
    replica_stats,
)

REQUEST_TIMEOUT_S = 60.0
# apps of the package-scoped fixtures below; any other app is deleted at the end of the module that deployed it
SHARED_APPS = frozenset({"main", "router-prefix-aware", "router-default"})


@dataclass(frozen=True)
class Cluster:
    http_port: int  # Serve's HTTP proxy on 127.0.0.1
    metrics_port: int  # Ray's metrics agent (Prometheus text) on this node
    gcs_address: str  # for processes that join the cluster (RAY_ADDRESS)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class App:
    name: str  # Serve application name (also its route prefix)
    base_url: str  # OpenAI base URL, ends in /v1
    model_path: str


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="package")
def cluster() -> Cluster:
    http_port, metrics_port = free_port(), free_port()
    ray.init(
        num_cpus=16,
        include_dashboard=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
        logging_level="WARNING",
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    yield Cluster(http_port, metrics_port, ray.get_runtime_context().gcs_address)
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(autouse=True, scope="module")
def delete_module_apps():
    """Deletes the apps a test module deployed for itself when it ends: idle replicas still take CPU (stats
    export, health checks, routing reports, a canary's checks)."""
    yield
    if ray.is_initialized():  # only the cluster fixture starts Ray here, and it starts Serve with it
        for name in serve.status().applications.keys() - SHARED_APPS:
            serve.delete(name)


def deploy(cluster: Cluster, name: str, args: dict[str, Any]) -> App:
    route = f"/{name}"
    serve.run(build_app({**args, "route_prefix": route}), name=name, route_prefix=route)
    return App(name, f"http://127.0.0.1:{cluster.http_port}{route}/v1", args["model_path"])


@pytest.fixture(scope="package")
def main_app(cluster: Cluster, tiny_model_path: str) -> App:
    return deploy(
        cluster,
        "main",
        {
            "model_path": tiny_model_path,
            "replicas": 2,
            "reasoning_parser": "nemotron_3",
            "tool_call_parser": "qwen3_coder",
            "group_max_requests": 64,  # (the default) grouped engine calls, each member routed on its own over two replicas
            # no background canary work while the fault tests compare pool usage
            "canary": {"enabled": False},
        },
    )


@pytest.fixture(scope="package")
def client(main_app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=main_app.base_url, api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="package")
def http(main_app: App) -> httpx.Client:
    with httpx.Client(base_url=main_app.base_url, timeout=REQUEST_TIMEOUT_S) as c:
        yield c


@dataclass(frozen=True)
class RouterRun:
    app: App
    hit_tokens: int  # engine-measured prefix-cache hit tokens, summed over replicas
    requests_per_replica: list[int]  # from each replica's prompt-token counter


@pytest.fixture(scope="package")
def router_runs(cluster: Cluster, tiny_model_path: str) -> dict[str, RouterRun]:
    workload = shared_prefix_workload(
        ROUTER_GROUPS,
        ROUTER_PER_GROUP,
        ROUTER_PREFIX_TOKENS,
        ROUTER_SUFFIX_TOKENS,
        token_id_range=(20, 900),
        order="interleaved",
        seed=1,
    )
    prompt_len = ROUTER_PREFIX_TOKENS + ROUTER_SUFFIX_TOKENS
    runs = {}
    for kind in ("prefix_aware", "default"):
        app = deploy(
            cluster,
            f"router-{kind.replace('_', '-')}",
            {
                "model_path": tiny_model_path,
                **ROUTER_CACHE_ARGS,
                "router": {"kind": kind},
                "canary": {"enabled": False},
            },
        )  # the test counts every request a replica served
        with httpx.Client(base_url=app.base_url, timeout=REQUEST_TIMEOUT_S) as c:
            for req in workload:
                resp = c.post(
                    "/completions",
                    json={"model": "tiny", "prompt": req.prompt_token_ids, "max_tokens": 1, "temperature": 0},
                )
                assert resp.status_code == 200, resp.text
        stats = replica_stats(app.name, 2).values()
        runs[kind] = RouterRun(
            app,
            sum(s["prefix_cache_hit_tokens"] for s in stats),
            sorted(s["prompt_tokens"] // prompt_len for s in stats),
        )
    return runs


@pytest.fixture(scope="module")
def canary_app(cluster, tiny_model_path):
    """One replica running the accuracy canary every second and auditing every request."""
    app = deploy(
        cluster,
        "canary",
        {
            "model_path": tiny_model_path,
            "replicas": 1,
            "group_max_requests": 1,  # one Serve call per request: the ungrouped path
            "canary": {"interval_s": 1.0, "audit_sample_rate": 1.0},
        },
    )
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        prefix = list(range(100, 100 + 70))
        for tail in (list(range(700, 705)), list(range(800, 809))):  # the second request hits the first's prefix
            assert (
                c.post("/completions", json={"model": "tiny", "prompt": prefix + tail, "max_tokens": 2}).status_code
                == 200
            )
    return app


@pytest.fixture(scope="module")
def small_app(cluster, tiny_model_path):
    """One replica that takes one request at a time (handle queue bound: 4): easy to overload."""
    return deploy(
        cluster,
        "small",
        {"model_path": tiny_model_path, "replicas": 1, "max_ongoing_requests": 1, "canary": {"enabled": False}},
    )
