"""A killed engine replica is replaced by Serve and requests keep succeeding."""

from __future__ import annotations

import ray
from ray import serve

from tests.deployments.serve_testkit import replica_stats, wait_until


def _engine_running_replicas(app_name: str) -> int:
    deployment = serve.status().applications[app_name].deployments["engine"]
    return deployment.replica_states.get("RUNNING", 0)


def test_killed_engine_replica_is_replaced(main_app, client):
    before = replica_stats(main_app.name, 2)
    victim_id, victim = next(iter(before.items()))
    ray.kill(ray.get_actor(victim["replica_actor_name"], namespace="serve"), no_restart=True)
    # requests succeed while the replacement starts (the router retries on the surviving replica)
    for i in range(4):
        out = client.completions.create(model="tiny", prompt=f"after the kill {i}", max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")

    def replaced() -> bool:
        return _engine_running_replicas(main_app.name) == 2 and victim_id not in replica_stats(main_app.name, 2)

    wait_until(replaced, timeout_s=90, interval_s=1, what="a replacement engine replica")
    after = replica_stats(main_app.name, 2)
    assert victim_id not in after and len(after.keys() & before.keys()) == 1
    for i in range(4):
        assert client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=3
        ).choices[0].finish_reason in ("stop", "length")
