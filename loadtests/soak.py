"""Soak test with faults against a hybrid-serve app on 127.0.0.1, bounded in time and requests.

    python -m loadtests.soak --duration-s 1800 --max-requests 200000 --concurrency 8   # the long run

Starts Ray and Serve on 127.0.0.1 (the embedded tiny model unless --model-path), deploys two engine
replicas with the prefix cache on, then: greedy outputs of a fixed probe set; a mixed load until the
deadline or the request budget (streaming and not, chat and completions, shared prefixes, clients
that disconnect mid-stream or abort before the answer), one engine replica killed with `ray.kill` at
--kill-at-s; then, once Serve has replaced it and the replicas are idle: every replica's pools hold
nothing but the prefix cache and `check_integrity` is clean (`stats(audit=True)`), the probe outputs
are unchanged, and resident memory growth per surviving replica is reported. Every request either
completes or gets a clear error (an HTTP error or SSE error event carrying an OpenAI error object);
one that runs past --request-timeout-s counts as a hang. Prints one JSON report; exit 1 if it failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

KINDS = ("stream", "nonstream", "disconnect", "abort")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 150.0  # load phase: no request starts after this
    max_requests: int = 100_000  # load phase: request budget
    concurrency: int = 6  # clients sending at once
    request_timeout_s: float = 30.0  # a request still running after this is a hang
    kill_at_s: float | None = 50.0  # seconds into the load when one engine replica is killed (None: never)
    seed: int = 0
    prefix_groups: int = 6  # shared prefixes (token ids for completions, system prompts for chat)
    prefix_tokens: int = 160
    max_tokens: int = 24  # largest max_tokens of a load request
    kind_weights: tuple[float, ...] = (0.35, 0.35, 0.15, 0.15)  # KINDS
    recover_timeout_s: float = 120.0  # for the replacement replica and idle pools after the load


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of KINDS
    result: str  # ok | client_disconnect | client_abort | error:<status>:<code> |
    # stream_error:<code> | unclear:<what> | hang
    latency_s: float


@dataclass
class SoakReport:
    requests: int = 0
    results: dict[str, int] = field(default_factory=dict)  # result -> count
    latency_ok_s: dict[str, float] = field(default_factory=dict)  # p50 / p99 / max of completed requests
    load_s: float = 0.0
    killed_replica: str | None = None
    replaced: bool = False
    prefix_cache_hit_tokens: int = 0  # over the replicas alive at the end (their counters since start)
    leaks: dict[str, list[str]] = field(default_factory=dict)  # replica id -> what is held (empty: clean)
    rss_mb: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> before / after / growth
    probes_unchanged: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def is_openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"])


def _error_result(resp: httpx.Response, text: bytes) -> str:
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"unclear:{resp.status_code}:not_json"
    if not is_openai_error(body):
        return f"unclear:{resp.status_code}:not_an_openai_error"
    return f"error:{resp.status_code}:{body['error'].get('code')}"


class LoadGenerator:
    """Builds and sends the mixed requests (one RNG, so a seed replays the same mix)."""

    def __init__(self, cfg: SoakConfig, model: str):
        self.cfg, self.model = cfg, model
        self.rng = random.Random(cfg.seed)
        self.prefixes = [
            [self.rng.randrange(20, 900) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.prefix_groups)
        ]
        self.systems = [
            f"You are assistant number {g}. " + " ".join(f"rule{g}-{i}" for i in range(60))
            for g in range(cfg.prefix_groups)
        ]

    def body(self, stream: bool) -> tuple[str, dict]:
        rng, g = self.rng, self.rng.randrange(self.cfg.prefix_groups)
        common = {
            "model": self.model,
            "max_tokens": rng.randint(1, self.cfg.max_tokens),
            "stream": stream,
            "temperature": rng.choice((0.0, 0.7, 1.0)),
            "ignore_eos": rng.random() < 0.5,
        }
        if rng.random() < 0.5:
            suffix = [rng.randrange(20, 900) for _ in range(rng.randint(1, 40))]
            return "/completions", {**common, "prompt": self.prefixes[g] + suffix}
        return "/chat/completions", {
            **common,
            "messages": [
                {"role": "system", "content": self.systems[g]},
                {"role": "user", "content": f"question {rng.randrange(10**6)}"},
            ],
        }

    async def one(self, client: httpx.AsyncClient) -> Outcome:
        kind = self.rng.choices(KINDS, weights=self.cfg.kind_weights)[0]
        path, body = self.body(stream=kind in ("stream", "disconnect"))
        stop_after_events = self.rng.randint(1, 3)
        abort_after_s = self.rng.uniform(0.02, 0.4)
        start = time.monotonic()
        try:
            if kind == "abort":
                try:
                    result = await asyncio.wait_for(self._plain(client, path, body), abort_after_s)
                except asyncio.TimeoutError:
                    result = "client_abort"
            else:
                call = (
                    self._stream(client, path, body, stop_after_events if kind == "disconnect" else None)
                    if body["stream"]
                    else self._plain(client, path, body)
                )
                result = await asyncio.wait_for(call, self.cfg.request_timeout_s)
        except asyncio.TimeoutError:
            result = "hang"
        except httpx.HTTPError as exc:
            result = f"unclear:transport:{type(exc).__name__}"
        return Outcome(kind, result, time.monotonic() - start)

    @staticmethod
    async def _plain(client: httpx.AsyncClient, path: str, body: dict) -> str:
        resp = await client.post(path, json=body)
        if resp.status_code != 200:
            return _error_result(resp, resp.content)
        return "ok" if resp.json().get("choices") else "unclear:200:no_choices"

    @staticmethod
    async def _stream(client: httpx.AsyncClient, path: str, body: dict, stop_after: int | None) -> str:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return _error_result(resp, await resp.aread())
            events, finished = 0, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok" if finished else "unclear:done_without_finish_reason"
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return (
                        f"stream_error:{chunk['error'].get('code')}"
                        if is_openai_error(chunk)
                        else "unclear:stream_error_not_openai"
                    )
                finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
                events += 1
                if stop_after is not None and events >= stop_after:
                    return "client_disconnect"  # leaving the block closes the connection
            return "unclear:stream_ended_without_done"


async def run_load(
    base_url: str, cfg: SoakConfig, model: str, headers: dict[str, str], kill: Any
) -> tuple[list[Outcome], str | None, float]:
    """The load phase; `kill()` (blocking) is run in a thread at cfg.kill_at_s and returns the victim's id."""
    gen = LoadGenerator(cfg, model)
    outcomes: list[Outcome] = []
    start = time.monotonic()
    deadline = start + cfg.duration_s
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    victim: str | None = None

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline and len(outcomes) < cfg.max_requests:
            outcomes.append(await gen.one(client))

    async def killer() -> None:
        nonlocal victim
        if cfg.kill_at_s is None or cfg.kill_at_s >= cfg.duration_s:
            return
        await asyncio.sleep(cfg.kill_at_s)
        victim = await asyncio.to_thread(kill)

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=cfg.request_timeout_s + 5, limits=limits
    ) as client:
        await asyncio.gather(killer(), *(worker(client) for _ in range(cfg.concurrency)))
    return outcomes, victim, time.monotonic() - start


def probe_outputs(base_url: str, model: str, headers: dict[str, str], prefixes: list[list[int]]) -> list[str]:
    """Greedy completions of a fixed probe set (two share a load prefix, so they hit the cache after)."""
    prompts = [prefixes[0] + [31, 41, 59], prefixes[1][:70] + [26, 53], list(range(100, 180)), [7, 8, 9]]
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as c:
        outs = []
        for p in prompts:
            resp = c.post(
                "/completions",
                json={"model": model, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            )
            resp.raise_for_status()
            outs.append(resp.json()["choices"][0]["text"])
    return outs


def replica_stats(app_name: str, num_replicas: int, audit: bool, timeout_s: float = 60.0) -> dict[str, dict]:
    """`stats(audit=...)` of every replica of the app's engine deployment, by replica id."""
    from ray import serve  # noqa: PLC0415  (only callers inside a Ray driver need it)

    handle = serve.get_deployment_handle("engine", app_name=app_name)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < num_replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"reached only replicas {sorted(seen)} of {num_replicas}")
        stats = handle.stats.remote(audit=audit).result(timeout_s=timeout_s)
        seen[stats["replica_id"]] = stats
    return seen


def kill_one_replica(app_name: str, num_replicas: int) -> str:
    import ray  # noqa: PLC0415

    replica_id, stats = sorted(replica_stats(app_name, num_replicas, audit=False).items())[0]
    ray.kill(ray.get_actor(stats["replica_actor_name"], namespace="serve"), no_restart=True)
    return replica_id


def wait_recovered(app_name: str, num_replicas: int, victim: str | None, timeout_s: float) -> dict[str, dict]:
    """Audited stats once `num_replicas` replicas (the victim not among them) run and hold no request."""
    from ray import serve  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    while True:
        running = serve.status().applications[app_name].deployments["engine"].replica_states.get("RUNNING", 0)
        stats = replica_stats(app_name, num_replicas, audit=True) if running == num_replicas else {}
        if stats and victim not in stats and all(s["pool_audit"]["requests_in_engine"] == 0 for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"{running} of {num_replicas} replicas running, not idle or not replaced")
        time.sleep(1.0)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50": statistics.median(ordered), "p99": p99, "max": ordered[-1]}


def run_soak(
    app_name: str,
    base_url: str,
    cfg: SoakConfig,
    model: str,
    num_replicas: int = 2,
    headers: dict[str, str] | None = None,
) -> SoakReport:
    """The whole soak against a deployed app (this process must be a driver of its Ray cluster)."""
    headers = headers or {}
    report = SoakReport()
    prefixes = LoadGenerator(cfg, model).prefixes
    probes_before = probe_outputs(base_url, model, headers, prefixes)
    before = replica_stats(app_name, num_replicas, audit=True)
    outcomes, victim, report.load_s = asyncio.run(
        run_load(base_url, cfg, model, headers, lambda: kill_one_replica(app_name, num_replicas))
    )
    report.requests, report.killed_replica = len(outcomes), victim
    report.results = dict(Counter(o.result for o in outcomes).most_common())
    report.latency_ok_s = _percentiles([o.latency_s for o in outcomes if o.result == "ok"])
    try:
        after = wait_recovered(app_name, num_replicas, victim, cfg.recover_timeout_s)
    except TimeoutError as exc:
        report.failures.append(f"no recovery: {exc}")
        return report
    report.replaced = victim is not None and victim not in after
    report.probes_unchanged = probe_outputs(base_url, model, headers, prefixes) == probes_before
    after = replica_stats(app_name, num_replicas, audit=True)  # after the probes too
    report.prefix_cache_hit_tokens = int(sum(s["prefix_cache_hit_tokens"] for s in after.values()))
    from service.deployments.pool_audit import PoolAudit  # noqa: PLC0415

    report.leaks = {rid: PoolAudit(**s["pool_audit"]).leaks() for rid, s in after.items()}
    mb = 1024 * 1024
    report.rss_mb = {
        rid: {
            "before": before[rid]["rss_bytes"] / mb,
            "after": after[rid]["rss_bytes"] / mb,
            "growth": (after[rid]["rss_bytes"] - before[rid]["rss_bytes"]) / mb,
        }
        for rid in before.keys() & after.keys()
    }
    report.failures += _failures(report, cfg)
    return report


def _failures(report: SoakReport, cfg: SoakConfig) -> list[str]:
    out = [f"{n} requests: {r}" for r, n in report.results.items() if r == "hang" or r.startswith("unclear")]
    out += [f"replica {rid} leaks: {leaks}" for rid, leaks in report.leaks.items() if leaks]
    if not report.probes_unchanged:
        out.append("greedy probe outputs changed")
    if cfg.kill_at_s is not None and cfg.kill_at_s < cfg.duration_s and not report.replaced:
        out.append("the killed replica was not replaced")
    if report.results.get("ok", 0) < report.requests // 2:
        out.append(f"only {report.results.get('ok', 0)} of {report.requests} requests completed")
    if report.prefix_cache_hit_tokens <= 0:
        out.append("the prefix cache never hit")
    return out


def soak_app_args(model_path: str, num_replicas: int = 2) -> dict[str, Any]:
    """The app under test: prefix cache on, small pools (evictions happen), no background canary."""
    return {
        "model_path": model_path,
        "replicas": num_replicas,
        "mamba_cache_strategy": "extra_buffer",
        "num_kv_pages": 512,
        "max_mamba_snapshots": 16,
        "max_num_seqs": 16,
        "canary": {"enabled": False},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SoakConfig()
    p.add_argument("--model-path", default=None, help="model folder (default: build the embedded tiny model)")
    p.add_argument("--duration-s", type=float, default=defaults.duration_s)
    p.add_argument("--max-requests", type=int, default=defaults.max_requests)
    p.add_argument("--concurrency", type=int, default=defaults.concurrency)
    p.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    p.add_argument("--kill-at-s", type=float, default=defaults.kill_at_s, help="negative: no replica is killed")
    p.add_argument("--seed", type=int, default=defaults.seed)
    ns = p.parse_args(argv)
    cfg = SoakConfig(
        duration_s=ns.duration_s,
        max_requests=ns.max_requests,
        concurrency=ns.concurrency,
        request_timeout_s=ns.request_timeout_s,
        kill_at_s=None if ns.kill_at_s < 0 else ns.kill_at_s,
        seed=ns.seed,
    )
    import socket  # noqa: PLC0415

    import ray  # noqa: PLC0415
    from ray import serve  # noqa: PLC0415

    from service.deployments.app import build_app  # noqa: PLC0415
    from service.testing.tiny import make_tiny_model  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        model_path = ns.model_path or make_tiny_model(f"{tmp}/tiny")
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(
                build_app({**soak_app_args(model_path), "route_prefix": "/soak"}), name="soak", route_prefix="/soak"
            )
            model = model_path.rstrip("/").rsplit("/", 1)[-1]
            report = run_soak("soak", f"http://127.0.0.1:{port}/soak/v1", cfg, model)
        finally:
            serve.shutdown()
            ray.shutdown()
    print(json.dumps({**asdict(report), "passed": report.passed}, indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
