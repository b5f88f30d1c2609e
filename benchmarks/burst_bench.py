"""Burst admission through `hybrid-serve serve`: B bursts of N streamed `/v1/completions` sent at once (random-token
prompts, few output tokens, ignore_eos), each after the previous one has finished; per burst: TTFT p50 / p90, wall
time, errors, and the CPU milliseconds per request of the engine replica, its engine core and the ingress (/proc).

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

import httpx

if __package__ in (None, ""):  # run as a script: the repository root is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serving_bench import write_model  # noqa: E402
from benchmarks.serving_procs import ServeProcess, cpu_delta_by_role, cpu_seconds_by_pid  # noqa: E402
from loadtests.bench_client import Summary, stream_request, summarize  # noqa: E402
from loadtests.workloads import random_token_prompts  # noqa: E402

ROLES = ("engine replica", "engine core", "ingress")  # the processes whose CPU per request is reported


async def burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> Summary:
    """All `prompts` sent at once, streamed, measured."""
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_request(client, "/completions", {**body, "prompt": p}) for p in prompts)
        )
        return summarize(list(results), time.perf_counter() - start)


def run(args: argparse.Namespace) -> list[dict]:
    n, max_tokens = args.burst
    model_path = write_model("tiny", args.model_dir, 0, "cpu")
    prompts = random_token_prompts(n * (args.bursts + 1), args.isl, (300, 1000), seed=args.seed)
    serve_args = ["--device", "cpu", "--kernel-backend", "torch", "--max-num-seqs", str(max(n, 1)), "--page-size",
                  "64", "--mamba-scheduler-strategy", "off", "--replicas", "1", *args.serve_extra.split()]  # fmt: skip
    rows = []
    with ServeProcess(model_path, serve_args, startup_timeout_s=args.startup_timeout_s) as server:
        print(f"server up in {server.startup_s:.1f} s", flush=True)
        asyncio.run(burst(server.base_url, server.model, prompts[:n], max_tokens))  # warm-up (connections, caches)
        for b in range(1, args.bursts + 1):
            time.sleep(args.pause_s)
            cpu0 = cpu_seconds_by_pid(server.pid)
            s = asyncio.run(burst(server.base_url, server.model, prompts[b * n : (b + 1) * n], max_tokens))
            cpu = cpu_delta_by_role(cpu0, cpu_seconds_by_pid(server.pid))
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
