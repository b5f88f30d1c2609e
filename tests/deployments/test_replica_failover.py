"""A killed engine replica, or a replica whose engine core process died, is replaced by Serve and requests keep
succeeding."""

from __future__ import annotations

import os
import signal

import ray
from ray import serve

from tests.deployments.serve_testkit import process_alive, reachable_replica_stats, replica_stats, wait_until


def _engine_running_replicas(app_name: str) -> int:
    deployment = serve.status().applications[app_name].deployments["engine"]
    return deployment.replica_states.get("RUNNING", 0)


def _replaced(app_name: str, victim_id: str) -> bool:
    """Serve runs 2 engine replicas again and this process' handle reaches 2, none of them the victim. One probe is
    short and never fails: right after the kill Serve may still count the victim as running while the handle
    already skips it, and a replacement that is still starting (tens of seconds on a loaded machine) is not
    reachable yet; the caller's wait_until bounds the whole wait."""
    if _engine_running_replicas(app_name) != 2:
        return False
    reached = reachable_replica_stats(app_name, 2, timeout_s=5.0)
    return len(reached) == 2 and victim_id not in reached


def test_killed_engine_replica_is_replaced(main_app, client):
    before = replica_stats(main_app.name, 2)
    victim_id, victim = next(iter(before.items()))
    ray.kill(ray.get_actor(victim["replica_actor_name"], namespace="serve"), no_restart=True)
    # requests succeed while the replacement starts (the router retries on the surviving replica)
    for i in range(4):
        out = client.completions.create(model="tiny", prompt=f"after the kill {i}", max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")

    wait_until(
        lambda: _replaced(main_app.name, victim_id), timeout_s=180, interval_s=1, what="a replacement engine replica"
    )
    after = replica_stats(main_app.name, 2)
    assert victim_id not in after and len(after.keys() & before.keys()) == 1
    for i in range(4):
        assert client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=3
        ).choices[0].finish_reason in ("stop", "length")


def test_dead_engine_core_fails_health_and_the_replica_is_replaced(main_app, client):
    """The engine core process of one replica is killed: the replica's health check fails, Serve replaces it (the
    old replica process and its engine core are gone, checked in /proc) and requests succeed again."""
    before = replica_stats(main_app.name, 2)
    victim_id, victim = next(iter(before.items()))
    core_pid = victim["engine_core_pid"]
    replica_pid = victim["replica_pid"]
    assert process_alive(core_pid) and process_alive(replica_pid)
    os.kill(core_pid, signal.SIGKILL)

    wait_until(
        lambda: _replaced(main_app.name, victim_id),
        timeout_s=180,
        interval_s=1,
        what="a replacement for the replica whose engine core died",
    )
    wait_until(lambda: not process_alive(replica_pid), timeout_s=60, what="the old replica process to exit")
    assert not process_alive(core_pid)
    after = replica_stats(main_app.name, 2)
    assert all(process_alive(s["engine_core_pid"]) for s in after.values())
    for i in range(4):
        out = client.completions.create(model="tiny", prompt=f"after the core died {i}", max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
