"""Served vs in-process: the same random-token workload through `hybrid-serve serve` (Ray Serve, OpenAI HTTP,
streaming) and through the engine in this process, in one call; prints both, the ratio, TTFT / TPOT / ITL
percentiles, errors, host CPU time per generated token of every serving process, and whether Ray's routers
logged queue-length warnings.

Workloads are `ISL:OSL:PROMPTS:CONCURRENCY` (random prompt token ids, `ignore_eos`, greedy; a closed loop: the
next request is sent when one finishes). The server is started as a subprocess (`python -m service.cli serve`,
its own local Ray cluster under a private RAY_TMPDIR) and stopped before the in-process engine is built, so the
two never share a device.

    # CPU, the embedded tiny model:
    PYTHONPATH=. python benchmarks/serving_bench.py --model tiny --device cpu --kernel-backend torch \\
        --workload 64:64:64:32
    # GPU, a Nano-shaped 8-layer model (MEM*EMEM, random bf16 weights, the embedded tokenizer):
    PYTHONPATH=. python benchmarks/serving_bench.py --model nano --device cuda --kernel-backend triton \\
        --workload 128:256:512:256 --workload 1024:1024:256:256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import httpx

if __package__ in (None, ""):  # run as a script: the repository root is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serving_cases import (  # noqa: E402
    ENDPOINTS,
    Case,
    Workload,
    case_key,
    make_cases,
    shorter_case,
    warmup_count,
    write_model,
)
from benchmarks.serving_client import closed_loop_clients, closed_loop_http  # noqa: E402
from benchmarks.serving_guidellm import cross_check  # noqa: E402
from benchmarks.serving_inprocess import run_inprocess  # noqa: E402
from benchmarks.serving_procs import (  # noqa: E402
    METRICS_REPORT_MS,
    ServeProcess,
    cpu_delta_by_role,
    cpu_seconds_by_pid,
    gpu_process_roles,
    metric_sums,
)
from benchmarks.serving_report import core_line, report, round_ratios, ttft_split  # noqa: E402
from loadtests.bench_client import Summary  # noqa: E402

CORE_METRICS = (  # the engine core's counters (summed over engine replicas), scraped around each timed run
    "ray_hybrid_serve_engine_core_seconds_total",
    "ray_hybrid_serve_engine_core_steps_total",
    "ray_hybrid_serve_generation_tokens_total",
    "ray_hybrid_serve_time_to_first_token_seconds_sum",  # measured in the engine replica (from its call to the
    "ray_hybrid_serve_time_to_first_token_seconds_count",  # first chunk): the client's TTFT less the path before it
)
# an engine replica's log line for each call it turned away at max_ongoing_requests (the ingress' router then retries
# it after a backoff of 25 ms, doubling up to 0.5 s)
AT_CAPACITY = "Replica at capacity of max_ongoing_requests"
METRICS_SETTLE_S = 1.0 + 3 * METRICS_REPORT_MS / 1e3  # the replica exports stats every 1 s, Ray reports them after


def run_served(args: argparse.Namespace, model_path: str, cases: list[Case], out: dict[str, dict]) -> None:
    """Fills `out` workload by workload (what finished stays there if a later one fails or is cut short)."""
    gpu_roles: dict[str, int] | str = "not a CUDA run"
    with ServeProcess(
        model_path,
        args.serve_args,
        log_path=args.serve_log,
        env=args.serve_env,
        startup_timeout_s=args.startup_timeout_s,
    ) as server:
        print(f"server up in {server.startup_s:.1f} s ({server.base_url})", flush=True)
        for case in cases:
            warm = Case(case.workload, case.endpoint, case.bodies[: warmup_count(case, args.warmup_prompts)], [])
            asyncio.run(
                closed_loop_http(
                    server.base_url,
                    server.model,
                    shorter_case(warm, args.warmup_tokens),
                    args.timeout_s,
                    args.http_client,
                )
            )
            for rep in range(args.served_repeats):
                key = case_key(case) + (f" (repeat {rep + 1})" if rep else "")
                out[key] = timed_served(args, server, case, key)
                if args.guidellm and case.endpoint == "completions" and rep == 0:
                    out[key].update(cross_check(args, server, case, model_path, Summary(**out[key]["summary"])))
        if args.device.startswith("cuda"):
            gpu_roles = gpu_process_roles(server.pid)
        out["_warnings"] = {
            "queue_length_warnings": server.count_log("Failed to get queue length"),
            "serve_log_dir": server.serve_log_dir,
            "gpu_processes": gpu_roles,
        }


def timed_served(args: argparse.Namespace, server: ServeProcess, case: Case, key: str) -> dict:
    """One timed closed loop of `case` against the running server: its summary, CPU seconds per role, the engine
    core's counters and the engine calls turned away at capacity over the run; prints its line."""
    core0 = core_counters(server)
    rejected0 = server.count_log(AT_CAPACITY)
    cpu0 = cpu_seconds_by_pid(server.pid)
    spies = start_py_spy(args, cpu0, key)
    summary, client_cpu_s = closed_loop_clients(
        server.base_url, server.model, case, args.timeout_s, args.client_procs, args.http_client
    )
    for spy in spies:
        spy.wait()
    cpu = cpu_delta_by_role(cpu0, cpu_seconds_by_pid(server.pid))
    core = {k: v - core0.get(k, 0.0) for k, v in core_counters(server).items()}
    cpu[f"client ({args.client_procs} processes)" if args.client_procs > 1 else "client (this process)"] = client_cpu_s
    rejected = server.count_log(AT_CAPACITY) - rejected0
    print(
        f"  served {key}: {summary.output_tokens_per_s:.0f} tok/s, errors {summary.num_errors}, "
        f"engine calls rejected at capacity {rejected}; {core_line(core, summary.duration_s)}; "
        f"{ttft_split(summary, core)}",
        flush=True,
    )
    return {"summary": asdict(summary), "cpu_s": cpu, "engine_core": core, "calls_rejected_at_capacity": rejected}


PY_SPY_ROLES = ("engine core", "engine replica", "ingress")  # the busiest process of each role is sampled


def start_py_spy(args: argparse.Namespace, procs: dict[int, tuple[str, float]], key: str) -> list[subprocess.Popen]:
    """With --py-spy-s: py-spy (on PATH) samples the busiest process of each PY_SPY_ROLES role for that long,
    without pausing it, into collapsed stacks `<out>.<key>.<role>.txt` (idle samples left out)."""
    if not args.py_spy_s:
        return []
    spies = []
    for role in PY_SPY_ROLES:
        busiest = max(((sec, pid) for pid, (r, sec) in procs.items() if r == role), default=None)
        if busiest is None:
            continue
        path = f"{args.out or 'serving_bench'}.{re.sub(r'[^A-Za-z0-9]+', '_', f'{key} {role}')}.txt"
        cmd = ["py-spy", "record", "--nonblocking", "--format", "raw", "--rate", "250"]
        cmd += ["--duration", str(args.py_spy_s), "--output", path, "--pid", str(busiest[1])]
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    return spies


def core_counters(server: ServeProcess) -> dict[str, float]:
    """The engine core's cumulative counters as Ray's metrics agent has them, once the latest have arrived."""
    time.sleep(METRICS_SETTLE_S)
    try:
        text = httpx.get(server.metrics_url, timeout=10.0).text
    except httpx.HTTPError as exc:
        print(f"  (metrics scrape failed: {exc})", flush=True)
        return {}
    return metric_sums(text, CORE_METRICS, split_label="phase")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    _add_engine_args(p)
    _add_served_args(p)
    _add_run_args(p)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.workloads = [Workload.parse(w) for w in (args.workload or ["64:64:64:32"])]
    args.endpoints = [e for e in args.endpoints.split(",") if e]
    if any("=" not in e for e in args.serve_env):
        p.error("--serve-env takes NAME=VALUE")
    args.serve_env = dict(e.split("=", 1) for e in args.serve_env)
    if not set(args.endpoints) <= set(ENDPOINTS):
        p.error(f"--endpoints: choose from {sorted(ENDPOINTS)}")
    args.serve_args = serve_args(args)
    return args


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The model and the engine settings both paths share."""
    p.add_argument("--model", choices=("tiny", "nano"), default="tiny", help="model this benchmark writes")
    p.add_argument("--model-dir", default=None, help="where to write (or reuse) the model folder")
    p.add_argument("--nano-experts", type=int, default=128, help="routed experts of the Nano-shaped model")
    p.add_argument("--workload", action="append", default=None, help="ISL:OSL:PROMPTS:CONCURRENCY (repeatable)")
    p.add_argument("--endpoints", default="completions", help="comma list of completions, chat")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kernel-backend", default="torch")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: both engines draw the same random weights from config.json (no weights file written or read)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--mamba-scheduler-strategy", default="off", help="prefix cache (off: every prompt computed)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the in-process engine on CPU (the engine "
        "replica gets 1 CPU from Ray, which sets its OMP_NUM_THREADS to 1)",
    )


def _add_served_args(p: argparse.ArgumentParser) -> None:
    """The server process, the HTTP client and the timed runs."""
    p.add_argument("--serve-extra", default="", help="more `hybrid-serve serve` flags, one string")
    p.add_argument(
        "--serve-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable of the server process (repeatable), e.g. a Ray Serve setting",
    )
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=0,
        help="prompts of the untimed warm-up run before each workload (0: the workload's concurrency)",
    )
    p.add_argument("--client-procs", type=int, default=1, help="client processes sharing the served closed loop (fork)")
    p.add_argument(
        "--http-client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the served closed loop's HTTP client (httpx costs each client process ~10-20x aiohttp's CPU per "
        "streamed request, which delays a burst of requests in the client itself)",
    )
    p.add_argument("--warmup-tokens", type=int, default=8)
    p.add_argument(
        "--served-repeats",
        type=int,
        default=1,
        help="timed served runs of each workload on the same server, back to back (reported as '(repeat N)'): "
        "the later ones find every kernel variant the first compiled",
    )
    p.add_argument(
        "--py-spy-s",
        type=int,
        default=0,
        help="sample the engine core, the engine replica and an ingress replica with py-spy (on PATH) for this many "
        "seconds from the start of each timed served run (collapsed stacks next to --out)",
    )


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Limits, which paths run and in which order, the guidellm cross-check, where the results go."""
    p.add_argument("--timeout-s", type=float, default=1200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-served", action="store_true")
    p.add_argument(
        "--inprocess-first",
        action="store_true",
        help="run the in-process engine before the server (its kernel compile caches then serve the server too)",
    )
    p.add_argument(
        "--startup-timeout-s", type=float, default=900.0, help="give up on a server not up after this many seconds"
    )
    p.add_argument("--skip-inprocess", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate this many served and in-process runs (a fresh server each) and print each round's ratio "
        "and their median: on a shared machine one round's ratio moves with the machine's speed",
    )
    p.add_argument(
        "--guidellm",
        action="store_true",
        help="also run guidellm (PyPI) against the same server on "
        "each completions workload, as an independent check of our client's numbers",
    )
    p.add_argument(
        "--guidellm-rounds",
        type=int,
        default=1,
        help="with --guidellm: alternate our client and guidellm this many times on the same server (ABAB...) "
        "and compare the medians",
    )
    p.add_argument("--serve-log", default=None, help="file for the server's output (default: in its temp dir)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The `hybrid-serve serve` flags of the parsed arguments (the engine settings, one replica, --serve-extra)."""
    return [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--kernel-backend",
        args.kernel_backend,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--page-size",
        str(args.page_size),
        "--mamba-scheduler-strategy",
        args.mamba_scheduler_strategy,
        "--load-format",
        args.load_format,
        "--replicas",
        "1",
        *args.serve_extra.split(),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir or os.path.join("/tmp", "serving_bench", args.model)
    t0 = time.perf_counter()
    model_path = write_model(args.model, model_dir, args.nano_experts, args.device, args.load_format)
    print(f"model {model_path} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    cases = make_cases(model_path, args.workloads, args.endpoints, args.seed)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a timeout's SIGTERM still stops the server tree (`with`)
    rounds: list[tuple[dict[str, dict], dict[str, dict]]] = []  # per round: (served, in-process) results by case
    try:
        for k in range(args.rounds):
            if args.rounds > 1:
                print(f"round {k + 1} of {args.rounds}", flush=True)
            rounds.append(({}, {}))
            run_round(args, model_path, cases, *rounds[-1])
    finally:  # also when cut short: whatever finished is reported
        for served, inproc in rounds:
            print("\n".join(report(served, inproc, cases)), flush=True)
        if len(rounds) > 1:
            print("\n".join(round_ratios(rounds, cases)), flush=True)
        if args.out:
            write_json(args.out, args, rounds)
    failed = any("_error" in served for served, _ in rounds)
    errors = sum(r["summary"]["num_errors"] for served, _ in rounds for r in served.values() if "summary" in r)
    return 2 if failed else 1 if errors else 0


def run_round(args: argparse.Namespace, model_path: str, cases: list[Case], served: dict, inproc: dict) -> None:
    """One served run (a fresh server) and one in-process run of every case, in the order the flags ask for."""
    if args.inprocess_first and not args.skip_inprocess:
        inproc.update(run_inprocess(args, model_path, cases))
    if not args.skip_served:
        try:
            run_served(args, model_path, cases, served)
        except RuntimeError as exc:  # the server did not come up: keep the in-process numbers
            print(f"served run failed: {exc}", flush=True)
            served["_error"] = {"message": str(exc)}
    if not args.skip_inprocess and not args.inprocess_first:
        inproc.update(run_inprocess(args, model_path, cases))


def write_json(path: str, args: argparse.Namespace, rounds: list[tuple[dict, dict]]) -> None:
    """The first round as "served" / "in_process" (and every round under "rounds" when there are several)."""
    first = rounds[0] if rounds else ({}, {})
    doc = {
        "args": {k: v for k, v in vars(args).items() if k != "workloads"},
        "served": first[0],
        "in_process": first[1],
    }
    if len(rounds) > 1:
        doc["rounds"] = [{"served": s, "in_process": i} for s, i in rounds]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
