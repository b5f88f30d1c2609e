"""Soak with faults (loadtests/soak.py), bounded to about a minute and a half: mixed streaming / non-streaming
load with shared prefixes, client disconnects and aborts, one engine replica killed mid-run, prefix cache
on. Passes when every request completed or got a clear error (none hung), the replicas' pools hold
nothing but the prefix cache and check_integrity is clean, and greedy probe outputs are unchanged.
The pool audit itself is checked in-process first: it must see a leaked page reference."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import pytest

from loadtests.soak import SoakConfig, run_soak, soak_app_args
from service.deployments.pool_audit import PoolAudit, audit_pools
from service.engine import Engine, EngineConfig, SamplingParams
from tests.deployments.conftest import deploy

SOAK = SoakConfig(duration_s=60.0, kill_at_s=20.0, request_timeout_s=30.0, concurrency=6, seed=16)
SOAK_BOUND_S = 150.0  # load (60 s) + the last requests' timeout + recovery and checks


def test_pool_audit_sees_what_requests_leave_behind(tiny_model_path):
    engine = Engine(
        EngineConfig(
            model_path=tiny_model_path,
            device="cpu",
            mamba_cache_strategy="extra_buffer",
            num_kv_pages=128,
            max_mamba_snapshots=8,
        )
    )
    prompt = list(range(40, 40 + 150))
    engine.generate([prompt, prompt[:100] + [7, 8]], SamplingParams(max_tokens=5, temperature=0))
    clean = PoolAudit(**audit_pools(engine))
    assert clean.leaks() == [] and clean.kv_pages_in_use > 0 and clean.snapshot_slots_in_use > 0, clean
    pages = engine.cache.pools.pages
    page = next(i for i, r in enumerate(pages.refcount) if r > 0)
    pages.incref([page])  # a reference nobody will drop
    assert PoolAudit(**audit_pools(engine)).leaks() == ["1 kv page references outside the cache"]
    pages.decref([page])
    engine.add_request(prompt[:30], SamplingParams(max_tokens=50), "busy")
    engine.step()
    assert PoolAudit(**audit_pools(engine)).leaks() == ["1 requests still in the engine"]


def test_soak_with_a_killed_replica(cluster, tiny_model_path):
    app = deploy(cluster, "soak", soak_app_args(tiny_model_path))
    start = time.monotonic()
    report = run_soak(app.name, app.base_url, SOAK, model="tiny")
    elapsed_s = time.monotonic() - start
    print("soak report:", json.dumps({**asdict(report), "elapsed_s": round(elapsed_s, 1)}))
    assert report.passed, report.failures
    assert report.killed_replica is not None and report.replaced
    assert {"ok", "client_disconnect", "client_abort"} <= set(report.results), report.results
    assert report.requests >= 100 and report.latency_ok_s["max"] < SOAK.request_timeout_s
    assert elapsed_s < SOAK_BOUND_S
    assert report.rss_mb, "at least one replica survived the whole run (memory growth measured)"


@pytest.mark.slow
def test_soak_long(cluster, tiny_model_path):
    app = deploy(cluster, "soak-long", soak_app_args(tiny_model_path))
    report = run_soak(app.name, app.base_url, SoakConfig(duration_s=1200.0, kill_at_s=400.0, seed=7), model="tiny")
    print("soak report:", json.dumps(asdict(report)))
    assert report.passed, report.failures
