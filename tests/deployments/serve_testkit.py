"""Helpers shared by the deployment tests (imported as `serve_testkit`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

# The router experiment: 8 prefix groups x 8 requests, interleaved, sent one by one, against 2 replicas whose
# caches hold about 4 group prefixes each (4 mamba snapshots, 90 KV pages of 16 tokens): with affinity every
# repeat hits; a prefix-blind router makes every replica cycle through all 8 groups and thrash its LRU.
ROUTER_GROUPS, ROUTER_PER_GROUP, ROUTER_PREFIX_TOKENS, ROUTER_SUFFIX_TOKENS = 8, 8, 256, 8
ROUTER_CACHE_ARGS = {"replicas": 2, "max_mamba_snapshots": 4, "num_kv_pages": 90, "max_num_seqs": 8}
# Bound on the wait for a value to show on Ray's metrics endpoint: each process exports through the node's metrics
# agent every metrics_report_interval (1 s in these tests), but on a 2-core machine where other processes keep the
# cores busy the first exports after a cluster or app start have taken over 30 s.
METRICS_EXPORT_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reachable_replica_stats(
    app_name: str, num_replicas: int, timeout_s: float, audit: bool = False
) -> dict[str, dict[str, Any]]:
    """engine.stats(audit) of the replicas of the app's engine deployment that this process' handle reaches within
    timeout_s, keyed by replica id: all num_replicas, or fewer when the time runs out (the handle's router spreads
    prompt-less calls over the least-loaded replicas it knows, so a few calls reach them all; a replica that Serve
    has just started is known to it only after the controller's next update). A replica that dies during the call
    is left out. Repeated hits on a known replica are spaced, so polling does not keep a core busy."""
    handle = serve.get_deployment_handle("engine", app_name=app_name)
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas and (left_s := deadline - time.monotonic()) > 0:
        try:
            stats = handle.stats.remote(audit=audit).result(timeout_s=left_s)
        except (TimeoutError, ray.exceptions.RayActorError):
            continue
        if stats["replica_id"] in seen:
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        seen[stats["replica_id"]] = stats
    return seen


def replica_stats(
    app_name: str, num_replicas: int, timeout_s: float = 30.0, audit: bool = False
) -> dict[str, dict[str, Any]]:
    """engine.stats(audit) of every replica of the app's engine deployment, keyed by replica id; fails when the
    handle does not reach num_replicas replicas within timeout_s."""
    seen = reachable_replica_stats(app_name, num_replicas, timeout_s, audit)
    assert len(seen) >= num_replicas, f"only reached replicas {sorted(seen)} of {num_replicas}"
    return seen


def wait_until(
    predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.25, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def process_alive(pid: int) -> bool:
    """pid exists and is not a zombie (read from /proc)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
