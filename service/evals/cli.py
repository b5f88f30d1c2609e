"""`hybrid-serve eval`: score an OpenAI-compatible endpoint on the synthetic tasks, or A/B the cache strategies.

    hybrid-serve eval --base-url http://127.0.0.1:8000/v1 --task addition,recall --num 200 --samples 1
    hybrid-serve eval --ab off,no_buffer,extra_buffer --model-path service/assets/tiny-trained
    hybrid-serve eval --ab off,extra_buffer --ab-url off=http://a:8000/v1 --ab-url extra_buffer=http://b:8000/v1

One table row per task (or per strategy and task) on stderr-free stdout, then one JSON line with everything.
With `--ab` and `--model-path`, one `hybrid-serve serve` per strategy is started on a free local port, used and
stopped in turn; `--ab-url strategy=URL` targets endpoints that already run with that strategy instead.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from service.evals.ab import STRATEGIES, run_ab
from service.evals.harness import OpenAIBackend, Sampling, score
from service.evals.tasks import MAX_TOKENS, TASKS, make_examples


async def _eval_tasks(args: argparse.Namespace) -> dict[str, Any]:
    backend = OpenAIBackend(args.base_url, args.model, concurrency=args.concurrency)
    temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 0.7)
    out = {}
    for task in args.task:
        examples = make_examples(task, args.num, args.seed)
        sampling = Sampling(args.samples, temperature, args.max_tokens or MAX_TOKENS[task], args.seed)
        result = score(task, examples, await backend.answer(examples, sampling))
        print(result.row(), flush=True)
        out[task] = dataclasses.asdict(result)
    return {"base_url": args.base_url, "temperature": temperature, "tasks": out}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hybrid-serve serve exited with code {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f}s")


def start_server(
    model_path: str, strategy: str, extra_args: list[str] = (), timeout_s: float = 600.0
) -> tuple[subprocess.Popen, str]:
    """`hybrid-serve serve` (1 replica, this cache strategy) on free local ports; returns (process, base URL)."""
    port, metrics_port = _free_port(), _free_port()
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model-path",
        model_path,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--replicas",
        "1",
        "--mamba-cache-strategy",
        strategy,
        "--reasoning-parser",
        "nemotron_3",
        "--tool-call-parser",
        "qwen3_coder",
        *extra_args,
    ]
    if strategy == "no_buffer":
        cmd += ["--page-size", "1"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_ready(url, proc, timeout_s)
    except Exception:
        stop_server(proc)
        raise
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (Serve shuts down), SIGKILL after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _eval_ab(args: argparse.Namespace) -> dict[str, Any]:
    urls = dict(item.split("=", 1) for item in args.ab_url)
    results = []
    for strategy in args.ab:
        proc = None
        if strategy in urls:
            url = urls[strategy]
        elif args.model_path:
            proc, url = start_server(args.model_path, strategy, args.serve_arg, args.start_timeout_s)
        else:
            raise SystemExit(f"--ab {strategy}: give --ab-url {strategy}=URL or --model-path to start one")
        try:
            (result,) = await run_ab(
                {strategy: OpenAIBackend(url, args.model, concurrency=args.concurrency)}, args.ab_contexts, args.seed
            )
        finally:
            if proc is not None:
                stop_server(proc)
        print("\n".join(result.rows()), flush=True)
        results.append(result)
    same = all(r.answers == results[0].answers for r in results)
    print(f"greedy answers identical across strategies: {same}", flush=True)
    return {
        "ab": {
            r.strategy: {"hit_ratio": r.hit_ratio, "accuracy": {t: s.pass_at_1 for t, s in r.scores.items()}}
            for r in results
        },
        "identical_answers": same,
    }


def _csv(choices: tuple[str, ...]):
    def parse(value: str) -> list[str]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        bad = [v for v in items if v not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"use a comma list of {', '.join(choices)}; got {value!r}")
        return items

    return parse


def _run_cli(args: argparse.Namespace) -> int:
    if args.ab is None and args.base_url is None:
        raise SystemExit("eval: give --base-url URL (or --ab STRATEGIES)")
    result = asyncio.run(_eval_ab(args) if args.ab is not None else _eval_tasks(args))
    line = json.dumps(result)
    print(line)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    return 0


def add_cli(subparsers: Any) -> None:
    p = subparsers.add_parser("eval", help="accuracy of an OpenAI endpoint on the synthetic tasks; cache A/B")
    p.add_argument("--base-url", default=None, help="OpenAI API base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name (default: the endpoint's first model)")
    p.add_argument("--task", type=_csv(TASKS), default=["addition"], help=f"comma list of {', '.join(TASKS)}")
    p.add_argument("--num", type=int, default=100, help="questions per task (held-out split)")
    p.add_argument("--samples", type=int, default=1, help="replies per question (K of pass@k, majority@k)")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 with 1 sample, else 0.7")
    p.add_argument("--max-tokens", type=int, default=None, help="default: per task (enough for its replies)")
    p.add_argument("--seed", type=int, default=0, help="question set seed (and the sampling seed)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--ab", type=_csv(STRATEGIES), default=None, help="cache A/B over these strategies")
    p.add_argument("--ab-url", action="append", default=[], help="STRATEGY=URL of a running endpoint (repeat)")
    p.add_argument("--ab-contexts", type=int, default=8, help="recall and state contexts in the A/B workload")
    p.add_argument("--model-path", default=None, help="with --ab: start `hybrid-serve serve` on this model")
    p.add_argument("--serve-arg", action="append", default=[], help="extra argument for the started servers")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="wait this long for a started server")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=_run_cli)
