"""Prefix-aware routing vs. Ray Serve's default router on the same shared-prefix workload (2 replicas)."""

from __future__ import annotations

from ray import serve

from service.engine.cache.block_hash import chained_block_hashes
from tests.deployments.serve_testkit import ROUTER_GROUPS, ROUTER_PER_GROUP, wait_until


def test_prefix_aware_router_hits_more_and_stays_balanced(router_runs):
    aware, default = router_runs["prefix_aware"], router_runs["default"]
    print(
        f"hit tokens: prefix-aware {aware.hit_tokens}, default {default.hit_tokens}; "
        f"requests per replica: {aware.requests_per_replica} vs {default.requests_per_replica}"
    )
    assert sum(aware.requests_per_replica) == sum(default.requests_per_replica) == ROUTER_GROUPS * ROUTER_PER_GROUP
    assert aware.hit_tokens >= 1.5 * default.hit_tokens, (aware, default)
    low, high = aware.requests_per_replica
    assert low > 0 and high <= 2 * low, aware.requests_per_replica


def test_replica_reports_speak_the_routers_hash_language(main_app, http):
    """What replicas report through routing stats (the router's index correction) are the router's own
    chained block hashes of the prompts they cached."""
    prompt = list(range(600, 600 + 200))
    assert http.post("/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).status_code == 200
    handle = serve.get_deployment_handle("engine", app_name=main_app.name)

    def reports() -> dict[str, dict] | None:
        seen: dict[str, dict] = {}
        for _ in range(8):
            report = handle.record_routing_stats.remote().result(timeout_s=30)
            seen[report["replica_id"]] = report
        return seen if len(seen) == 2 else None

    # generous: on a 2-core CI machine a replica replaced by the failover test may still be starting
    by_replica = wait_until(reports, timeout_s=120, interval_s=1, what="reports from both replicas")
    grid = {r["snapshot_grid_tokens"] for r in by_replica.values()}.pop()
    expected = chained_block_hashes(prompt, grid)[: (len(prompt) - 1) // grid]
    holders = [rid for rid, r in by_replica.items() if set(expected) <= set(r["cached_prefix_hashes"])]
    assert len(holders) >= 1, "no replica reports the prefix it just cached"
    assert all(r["report_seq"] >= 1 for r in by_replica.values())
