"""Burst admission through `hybrid-serve serve`: B bursts of N streamed `/v1/completions` sent at once (random-token
prompts, few output tokens, ignore_eos), each after the previous one has finished; per burst: TTFT p50 / p90, wall
time, errors, and the CPU milliseconds per request of the engine replica, its engine core, the ingress and this
client (/proc).

What it shows: how long a burst waits to be admitted when every request is one Serve call into the single engine
replica (its per-call work runs one call after another on its event loop).

    PYTHONPATH=. python benchmarks/burst_bench.py --bursts 3 --burst 256:2     # CPU, the embedded tiny model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serving_cases import Case, Workload, write_model  # noqa: E402
from benchmarks.serving_client import closed_loop_http  # noqa: E402
from benchmarks.serving_procs import ServeProcess, cpu_delta_by_role, cpu_seconds_by_pid, own_cpu_seconds  # noqa: E402
from loadtests.bench_client import Summary  # noqa: E402
from loadtests.workloads import random_token_prompts  # noqa: E402

ROLES = ("engine replica", "engine core", "ingress", "client")  # the processes whose CPU per request is reported


async def burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, http_client: str) -> Summary:
    """All `prompts` sent at once, streamed, measured."""
    bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True} for p in prompts]
    case = Case(Workload(len(prompts[0]), max_tokens, len(prompts), len(prompts)), "completions", bodies, [])
    summary, _ = await closed_loop_http(base_url, model, case, 600.0, http_client)
    return summary


def run(args: argparse.Namespace) -> list[dict]:
    n, max_tokens = args.burst
    model_path = write_model("tiny", args.model_dir, 0, "cpu")
    prompts = random_token_prompts(n * (args.bursts + 1), args.isl, (300, 1000), seed=args.seed)
    serve_args = ["--device", "cpu", "--kernel-backend", "torch", "--max-num-seqs", str(max(n, 1)), "--page-size",
                  "64", "--mamba-scheduler-strategy", "off", "--replicas", "1", *args.serve_extra.split()]  # fmt: skip
    rows = []
    with ServeProcess(model_path, serve_args, startup_timeout_s=args.startup_timeout_s) as server:
        print(f"server up in {server.startup_s:.1f} s", flush=True)
        warm = burst(server.base_url, server.model, prompts[:n], max_tokens, args.http_client)
        asyncio.run(warm)  # warm-up (connections, caches)
        for b in range(1, args.bursts + 1):
            time.sleep(args.pause_s)
            cpu0, own0 = cpu_seconds_by_pid(server.pid), own_cpu_seconds()
            s = asyncio.run(
                burst(server.base_url, server.model, prompts[b * n : (b + 1) * n], max_tokens, args.http_client)
            )
            cpu = cpu_delta_by_role(cpu0, cpu_seconds_by_pid(server.pid))
            cpu["client"] = own_cpu_seconds() - own0
            row = {
                "burst": b,
                "ttft_p50_ms": round(1e3 * s.ttft.get("p50", float("nan")), 1),
                "ttft_p90_ms": round(1e3 * s.ttft.get("p90", float("nan")), 1),
                "wall_s": round(s.duration_s, 3),
                "errors": s.num_errors,
                "cpu_ms_per_request": {r: round(1e3 * cpu.get(r, 0.0) / n, 3) for r in ROLES},
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--burst", default="256:2", help="N:MAX_TOKENS: requests per burst and output tokens of each")
    p.add_argument("--bursts", type=int, default=3, help="timed bursts (after one untimed warm-up burst)")
    p.add_argument("--isl", type=int, default=16, help="prompt tokens")
    p.add_argument("--pause-s", type=float, default=0.5, help="idle time before each burst")
    p.add_argument("--model-dir", default="/tmp/serving_bench/tiny")
    p.add_argument("--serve-extra", default="", help="more `hybrid-serve serve` flags, one string")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http-client", choices=("aiohttp", "httpx"), default="aiohttp", help="the client sending bursts")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    parts = args.burst.split(":")
    if len(parts) != 2 or not all(x.isdigit() and int(x) > 0 for x in parts):
        p.error(f"--burst must be N:MAX_TOKENS (positive ints), got {args.burst!r}")
    args.burst = tuple(map(int, parts))
    rows = run(args)
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in ("ttft_p50_ms", "ttft_p90_ms", "wall_s")}
        cpu = {role: statistics.median(r["cpu_ms_per_request"][role] for r in rows) for role in ROLES}
        print(f"median of {len(rows)} bursts: {json.dumps(med)}; CPU ms per request {json.dumps(cpu)}", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": {**vars(args), "burst": list(args.burst)}, "bursts": rows}, f, indent=2)
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
