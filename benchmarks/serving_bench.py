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
import contextlib
import functools
import json
import multiprocessing
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import aiohttp
import httpx

if __package__ in (None, ""):  # run as a script: the repository root is the import root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serving_procs import (  # noqa: E402
    METRICS_REPORT_MS,
    ServeProcess,
    cpu_delta_by_role,
    cpu_seconds_by_pid,
    gpu_process_roles,
    metric_sums,
    own_cpu_seconds,
)
from loadtests.bench_client import (  # noqa: E402
    RequestResult,
    Summary,
    stream_request,
    stream_request_aiohttp,
    summarize,
)
from loadtests.workloads import random_token_prompts  # noqa: E402

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
CORE_METRICS = (  # the engine core's counters (summed over engine replicas), scraped around each timed run
    "ray_hybrid_serve_engine_core_seconds_total",
    "ray_hybrid_serve_engine_core_steps_total",
    "ray_hybrid_serve_generation_tokens_total",
)
# an engine replica's log line for each call it turned away at max_ongoing_requests (the ingress' router then retries
# it after a backoff of 25 ms, doubling up to 0.5 s)
AT_CAPACITY = "Replica at capacity of max_ongoing_requests"
METRICS_SETTLE_S = 1.0 + 3 * METRICS_REPORT_MS / 1e3  # the replica exports stats every 1 s, Ray reports them after
NANO_OVERRIDES = {  # Nemotron-3 Nano 30B-A3B shapes (tests/engine/fixtures/nano_30b_a3b_config.json), 8 layers
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEM*EMEM",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "chunk_size": 128,
    "expand": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "intermediate_size": 1856,
    "routed_scaling_factor": 2.5,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
    "time_step_limit": [0.0, 1e9],
}


@dataclass(frozen=True)
class Workload:
    isl: int  # prompt tokens
    osl: int  # output tokens (ignore_eos)
    num_prompts: int
    concurrency: int  # requests in flight at most

    @classmethod
    def parse(cls, text: str) -> Workload:
        parts = text.split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--workload must be ISL:OSL:PROMPTS:CONCURRENCY (positive ints), got {text!r}")
        return cls(*map(int, parts))

    @property
    def label(self) -> str:
        return f"{self.isl}in/{self.osl}out x{self.num_prompts} c{self.concurrency}"


@dataclass(frozen=True)
class Case:
    """One workload on one endpoint, with its prompts (token ids as the engine sees them)."""

    workload: Workload
    endpoint: str  # "completions" | "chat"
    bodies: list[dict]  # HTTP request bodies (without model / stream fields)
    engine_prompts: list[list[int]]  # the same prompts as token ids (chat: template applied and encoded)


# ---------------------------------------------------------------- model folders
def write_model(kind: str, out_dir: str, nano_experts: int, device: str, load_format: str = "auto") -> str:
    """The embedded tiny model, or a Nano-shaped 8-layer model with random bf16 weights and the embedded
    tokenizer (with load_format "dummy": no weights file, the engines draw them); an existing folder is reused."""
    from service.testing import tiny  # noqa: PLC0415

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    partial = out_dir + ".partial"
    tiny.make_tiny_model(partial)  # tokenizer files (and the tiny model's weights)
    if kind == "nano":
        from safetensors.torch import save_file  # noqa: PLC0415

        config = tiny.tiny_config(
            tiny.train_tokenizer(),
            **{**NANO_OVERRIDES, "n_routed_experts": nano_experts, "num_experts_per_tok": min(6, nano_experts)},
        )
        weights_path = os.path.join(partial, "model.safetensors")
        if load_format == "dummy":
            os.remove(weights_path)
        else:
            save_file(nano_weights(config, device), weights_path, metadata={"format": "pt"})
        with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    os.replace(partial, out_dir)
    return out_dir


def nano_weights(config: dict, device: str, seed: int = 0) -> dict:
    """bf16 checkpoint tensors: `tiny.random_weights` of the same model with one routed expert (on the CPU), and
    the router and every routed expert drawn on `device` (normal(0, initializer_range); the correction bias
    normal(0, 0.1) as `tiny` draws it): the experts are ~95 % of the parameters."""
    import torch  # noqa: PLC0415

    from service.testing import tiny  # noqa: PLC0415

    one = tiny.random_weights({**config, "n_routed_experts": 1, "num_experts_per_tok": 1}, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    experts, std = config["n_routed_experts"], config["initializer_range"]

    def draw(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(torch.bfloat16).cpu()

    out = {}
    for name, t in one.items():
        if name.endswith(".mixer.gate.weight") or name.endswith(".mixer.gate.e_score_correction_bias"):
            out[name] = draw((experts, *t.shape[1:]), 0.1 if name.endswith("bias") else std)
        elif ".mixer.experts.0." in name:
            for j in range(experts):
                out[name.replace(".experts.0.", f".experts.{j}.")] = draw(tuple(t.shape), std)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def make_cases(model_path: str, workloads: list[Workload], endpoints: list[str], seed: int) -> list[Case]:
    from service.engine.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_model_path(model_path)
    lo = max(tok.special_token_ids | {0}) + 1  # plain vocabulary tokens only
    cases = []
    for w in workloads:
        prompts = random_token_prompts(w.num_prompts, w.isl, (lo, tok.vocab_size), seed=seed)
        base = {"max_tokens": w.osl, "temperature": 0.0, "ignore_eos": True}
        for ep in endpoints:
            if ep == "completions":
                cases.append(Case(w, ep, [{**base, "prompt": p} for p in prompts], prompts))
                continue
            texts = [tok.decode(p) for p in prompts]
            ids = [
                tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
                for t in texts
            ]
            cases.append(Case(w, ep, [{**base, "messages": [{"role": "user", "content": t}]} for t in texts], ids))
    return cases


# ---------------------------------------------------------------- served
async def _closed_loop_http(
    base_url: str, model: str, case: Case, timeout_s: float, http_client: str
) -> tuple[Summary, list]:
    """The case's requests streamed at its concurrency (a closed loop) over `http_client` ("aiohttp" or "httpx")."""
    conc = case.workload.concurrency
    path = ENDPOINTS[case.endpoint]
    async with contextlib.AsyncExitStack() as stack:
        if http_client == "aiohttp":
            session = await stack.enter_async_context(
                aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=conc + 8), timeout=aiohttp.ClientTimeout(total=timeout_s)
                )
            )
            send = functools.partial(stream_request_aiohttp, session, base_url + path)
        else:
            limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc + 8)
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits)
            )
            send = functools.partial(stream_request, client, path)
        gate = asyncio.Semaphore(conc)

        async def one(body: dict) -> RequestResult:
            async with gate:
                return await send({**body, "model": model})

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in case.bodies))
        return summarize(list(results), time.perf_counter() - start), list(results)


def _client_results(base_url: str, model: str, case: Case, timeout_s: float, http_client: str) -> list[RequestResult]:
    """One client process' share of a closed loop (run in a worker process)."""
    return asyncio.run(_closed_loop_http(base_url, model, case, timeout_s, http_client))[1]


def _started(_: int) -> None:
    """A no-op task: the pool's worker processes exist once it has run."""


def closed_loop_clients(
    base_url: str, model: str, case: Case, timeout_s: float, procs: int, http_client: str
) -> tuple[Summary, float]:
    """(summary, client CPU seconds) of the closed loop run by `procs` client processes (forked before the clock
    starts), each with every procs-th request and its share of the concurrency, so that one client's event loop is
    not the limit."""
    if procs == 1:
        own0 = own_cpu_seconds()
        summary, _ = asyncio.run(_closed_loop_http(base_url, model, case, timeout_s, http_client))
        return summary, own_cpu_seconds() - own0
    w = case.workload
    parts = []
    for i in range(procs):
        bodies = case.bodies[i::procs]
        conc = w.concurrency // procs + (i < w.concurrency % procs)
        parts.append(Case(Workload(w.isl, w.osl, len(bodies), max(conc, 1)), case.endpoint, bodies, []))
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_started, range(procs)))
        start = time.perf_counter()
        futures = [pool.submit(_client_results, base_url, model, part, timeout_s, http_client) for part in parts]
        results = [r for f in futures for r in f.result()]
        duration = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime
    return summarize(results, duration), cpu


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
            warm = Case(case.workload, case.endpoint, case.bodies[: _warmup_prompts(args, case)], [])
            asyncio.run(
                _closed_loop_http(
                    server.base_url, server.model, _shorter(warm, args.warmup_tokens), args.timeout_s, args.http_client
                )
            )
            for rep in range(args.served_repeats):
                key = _key(case) + (f" (repeat {rep + 1})" if rep else "")
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
        f"engine calls rejected at capacity {rejected}; {core_line(core, summary.duration_s)}",
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


def core_line(core: dict[str, float], duration_s: float) -> str:
    """Where the engine core's wall time went over a timed run, per step: host work in Engine.step, waiting for the
    device in it, its sender thread; and outputs per step."""
    steps = core.get("ray_hybrid_serve_engine_core_steps_total", 0.0)
    if steps <= 0:
        return "engine core: no counters"
    tokens = core.get("ray_hybrid_serve_generation_tokens_total", 0.0)
    ph = {
        p: core.get(f"ray_hybrid_serve_engine_core_seconds_total{{{p}}}", 0.0)
        for p in ("host", "device_wait", "send", "gc")
    }
    in_step = ph["host"] + ph["device_wait"]
    return (
        f"engine core: {steps:.0f} steps, {tokens / steps:.1f} outputs/step, "
        f"{1e3 * in_step / steps:.2f} ms/step in Engine.step ({in_step / duration_s:.2f} of the run; host "
        f"{1e3 * ph['host'] / steps:.2f}, device wait {1e3 * ph['device_wait'] / steps:.2f}), "
        f"sender {1e3 * ph['send'] / steps:.3f} ms/step, garbage collector {1e3 * ph['gc'] / steps:.3f} ms/step"
    )


def cross_check(args: argparse.Namespace, server: ServeProcess, case: Case, model_path: str, ours: Summary) -> dict:
    """guidellm right after our timed run, then `--guidellm-rounds` - 1 more pairs (ours, guidellm) on the same
    server (ABAB...): every run's output tok/s and TTFT p50 (ours to the first text, guidellm's definition), and
    their medians, so that the drift of a shared machine falls on both clients alike. With more than one round
    both clients send the same text prompts (the case's token ids decoded; guidellm reads them from a JSONL file,
    so it synthesises and counts nothing while it runs), and round 1 reruns ours on them."""
    data = None
    if args.guidellm_rounds > 1:
        case, data = _text_prompts(case, model_path, os.path.join(server.tmp, "prompts.jsonl"))
    runs = []
    for i in range(args.guidellm_rounds):
        if i > 0 or data is not None:
            ours, _ = closed_loop_clients(
                server.base_url, server.model, case, args.timeout_s, args.client_procs, args.http_client
            )
        runs.append(
            {
                "client": "ours",
                "output_tokens_per_s": ours.output_tokens_per_s,
                "ttft_p50_s": (ours.ttft_text or ours.ttft)["p50"],
                "ttft_token_p50_s": ours.ttft["p50"],
                "errors": ours.num_errors,
                "load_avg_1m": os.getloadavg()[0],
            }
        )
        gl = run_guidellm(server, case.workload, model_path, args.timeout_s, data)
        if "error" in gl:
            return {"guidellm": gl, "rounds": runs}
        runs.append({"client": "guidellm", **gl, "load_avg_1m": os.getloadavg()[0]})
        print(
            f"  round {i + 1}: ours {runs[-2]['output_tokens_per_s']:.0f} tok/s TTFT {1e3 * runs[-2]['ttft_p50_s']:.1f}"
            f" ms, guidellm {gl['output_tokens_per_s']:.0f} tok/s TTFT {1e3 * gl['ttft_p50_s']:.1f} ms",
            flush=True,
        )
    return {"guidellm": runs[1], "rounds": runs}


def _text_prompts(case: Case, model_path: str, path: str) -> tuple[Case, str]:
    """The case with its prompts as text (decoded token ids), and the same prompts written as guidellm data."""
    from service.engine.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_model_path(model_path)
    texts = [tok.decode(ids) for ids in case.engine_prompts]
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"prompt": text, "output_tokens_count": case.workload.osl}) + "\n")
    bodies = [{**b, "prompt": t} for b, t in zip(case.bodies, texts)]
    return Case(case.workload, case.endpoint, bodies, [tok.encode(t) for t in texts]), path


def _median_of(runs: list[dict], client: str, key: str) -> float:
    return statistics.median(r[key] for r in runs if r["client"] == client)


def run_guidellm(server: ServeProcess, w: Workload, model_path: str, timeout_s: float, data: str | None = None) -> dict:
    """The same workload shape from guidellm (its own client; its own synthetic prompts, or the JSONL file `data`)
    against the same server: output tok/s and TTFT p50 as guidellm reports them."""
    path = os.path.join(server.tmp, "guidellm.json")
    backend = {
        "kind": "openai_http",
        "target": server.base_url.removesuffix("/v1"),
        "model": server.model,
        "request_format": "/v1/completions",
        "http2": False,
        "extras": {"body": {"ignore_eos": True, "temperature": 0.0}},
    }
    cmd = [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        json.dumps(backend),
        "--profile",
        json.dumps({"kind": "concurrent", "streams": [w.concurrency]}),
        "--data",
        json.dumps(
            {"kind": "json_file", "path": data}
            if data
            else {"kind": "synthetic_text", "prompt_tokens": w.isl, "output_tokens": w.osl}
        ),
        "--tokenizer",
        json.dumps({"kind": "huggingface_auto", "model": model_path}),
        "--constraint",
        json.dumps({"kind": "max_requests", "count": w.num_prompts}),
        "--output",
        json.dumps({"kind": "json", "path": path}),
        "--disable-progress",
    ]
    # one client process that does not spin (its defaults: up to 10 workers polling every 0.1 ms, which on a
    # small machine take the server's CPU); its log file goes to the server's temp dir
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "GUIDELLM__DEFAULT_ASYNC_LOOP_SLEEP": "0.001",
        "GUIDELLM__LOGGING__LOG_FILE": os.path.join(server.tmp, "guidellm.log"),
    }
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=server.tmp)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not os.path.exists(path):
        return {"error": f"guidellm exited {done.returncode}: {done.stderr[-2000:]}"}
    with open(path, encoding="utf-8") as f:
        metrics = json.load(f)["benchmarks"][0]["metrics"]
    return {
        "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
        "ttft_p50_s": metrics["time_to_first_token_ms"]["successful"]["median"] / 1e3,
        "errored": metrics["request_totals"]["errored"],
        "successful": metrics["request_totals"]["successful"],
        "client_cpu_s": children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime,
        "command": " ".join(cmd[2:]),
    }


def _warmup_prompts(args: argparse.Namespace, case: Case) -> int:
    return args.warmup_prompts or case.workload.concurrency


def _shorter(case: Case, max_tokens: int) -> Case:
    bodies = [{**b, "max_tokens": min(max_tokens, b["max_tokens"])} for b in case.bodies]
    return Case(case.workload, case.endpoint, bodies, case.engine_prompts)


def _key(case: Case) -> str:
    return f"{case.endpoint} {case.workload.label}"


# ---------------------------------------------------------------- in-process
def run_inprocess(args: argparse.Namespace, model_path: str, cases: list[Case]) -> dict[str, dict]:
    import torch  # noqa: PLC0415

    from service.engine import Engine  # noqa: PLC0415

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    engine = Engine(engine_config(args, model_path))
    out = {}
    for case in cases:
        closed_loop_engine(
            engine,
            case.engine_prompts[: _warmup_prompts(args, case)],
            min(args.warmup_tokens, case.workload.osl),
            case.workload.concurrency,
        )
        own0, steps0, split0 = own_cpu_seconds(), engine.num_steps, dict(engine.step_seconds)
        summary = closed_loop_engine(engine, case.engine_prompts, case.workload.osl, case.workload.concurrency)
        steps = max(engine.num_steps - steps0, 1)
        split = {k: engine.step_seconds[k] - split0[k] for k in split0}  # schedule / execute (waits) / update
        out[_key(case)] = {
            "summary": asdict(summary),
            "cpu_s": {"engine (this process)": own_cpu_seconds() - own0},
            "steps": steps,
            "step_seconds": split,
        }
        print(
            f"  in-process {_key(case)}: {summary.output_tokens_per_s:.0f} tok/s; {steps} steps, "
            f"{summary.output_tokens / steps:.1f} outputs/step, {1e3 * summary.duration_s / steps:.2f} ms/step wall "
            f"(host {1e3 * (split['schedule'] + split['update']) / steps:.2f}, "
            f"device wait {1e3 * split['execute'] / steps:.2f})",
            flush=True,
        )
    engine.shutdown()  # the device memory goes back before a server (--inprocess-first) builds its engine
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def engine_config(args: argparse.Namespace, model_path: str):
    from service.engine import EngineConfig  # noqa: PLC0415

    return EngineConfig(
        model_path=model_path,
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kernel_backend=args.kernel_backend,
        mamba_cache_strategy=args.mamba_scheduler_strategy,
        load_format=args.load_format,
    )


def closed_loop_engine(engine, prompts: list[list[int]], osl: int, concurrency: int) -> Summary:
    """At most `concurrency` requests in `engine`, the next added when one finishes; per-request timings as a
    client would see them (TTFT from the add, a gap per output)."""
    from service.engine import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    pending = list(reversed(prompts))
    sent, first, last, gaps, done, outs = {}, {}, {}, {}, {}, {}
    start = time.perf_counter()
    while pending or len(done) < len(sent):
        while pending and len(sent) - len(done) < concurrency:
            rid = engine.add_request(pending.pop(), params)
            sent[rid], gaps[rid] = time.perf_counter(), []
        for o in engine.step():
            now = time.perf_counter()
            if o.num_output_tokens == 0:
                continue
            if o.request_id in first:
                gaps[o.request_id].append(now - last[o.request_id])
            first.setdefault(o.request_id, now)
            last[o.request_id], outs[o.request_id] = now, o.num_output_tokens
            if o.finished:
                done[o.request_id] = now
    duration = time.perf_counter() - start
    results = [
        RequestResult(
            first[r] - sent[r], tuple(gaps[r]), done[r] - sent[r], 0, 0, outs[r], "", num_chunks=len(gaps[r]) + 1
        )
        for r in sent
    ]
    return summarize(results, duration)


# ---------------------------------------------------------------- report
def _ms(d: dict, key: str) -> str:
    return f"{1e3 * d[key]:.1f}" if key in d else "-"


def report(served: dict, inproc: dict, cases: list[Case]) -> list[str]:
    lines = [
        "| workload | path | output tok/s | ratio | TTFT p50 / p90 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms "
        "| tokens/chunk | errors | host CPU ms per output token |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---|",
    ]
    for case in cases:
        key = _key(case)
        base = inproc.get(key, {}).get("summary", {}).get("output_tokens_per_s")
        runs = [("in-process", key, inproc.get(key))]
        runs += [("served", k, r) for k, r in served.items() if k == key or k.startswith(key + " (repeat")]
        for path, label, res in runs:
            if res is None:
                continue
            s = res["summary"]
            ratio = f"{s['output_tokens_per_s'] / base:.2f}x" if base else "-"
            cpu = ", ".join(
                f"{role} {1e3 * sec / max(s['output_tokens'], 1):.2f}"
                for role, sec in res["cpu_s"].items()
                if sec > 0.005
            )
            t, tp, itl = s["ttft"], s["tpot"], s["itl"]
            lines.append(
                f"| {label} | {path} | {s['output_tokens_per_s']:.0f} | {ratio} | {_ms(t, 'p50')} / "
                f"{_ms(t, 'p90')} / {_ms(t, 'p99')} | {_ms(tp, 'p50')} | {_ms(itl, 'p50')} / {_ms(itl, 'p99')} "
                f"| {s['tokens_per_chunk']:.2f} | {s['num_errors']} | {cpu} |"
            )
            gl, rounds = res.get("guidellm"), res.get("rounds", [])
            if len(rounds) > 2 and "error" not in gl:  # alternating rounds on the same text prompts
                lines.append(_rounds_row(rounds))
            elif gl:
                lines.append(_guidellm_row(gl, s))
            if s.get("first_error"):
                lines.append(f"|  | first error: {s['first_error'][:200]} |")
    warn = served.get("_warnings")
    if warn is not None:
        lines.append(
            f"\nqueue-length warnings in the serve logs: {warn['queue_length_warnings']} ({warn['serve_log_dir']})"
        )
        lines.append(f"server processes holding a CUDA context, by role: {warn.get('gpu_processes')}")
    return lines


def _guidellm_row(gl: dict, s: dict) -> str:
    """guidellm's numbers against ours. Its TTFT ends at the first event with text, as our `ttft_text` does (our
    `ttft` ends at the first event with a token, which may have no text yet): TTFT is compared on that definition."""
    if "error" in gl:
        return f"|  | guidellm failed: {gl['error'][:300]} |"
    ours = s.get("ttft_text", {}).get("p50") or s["ttft"]["p50"]
    return (
        f"|  | guidellm | {gl['output_tokens_per_s']:.0f} "
        f"({100 * (gl['output_tokens_per_s'] / s['output_tokens_per_s'] - 1):+.1f} %) | | "
        f"p50 {1e3 * gl['ttft_p50_s']:.1f} ({100 * (gl['ttft_p50_s'] / ours - 1):+.1f} % against our p50 to the "
        f"first text, {1e3 * ours:.1f}; to the first token {1e3 * s['ttft']['p50']:.1f}) | | | "
        f"| {gl['errored']} | guidellm client {1e3 * gl['client_cpu_s'] / max(s['output_tokens'], 1):.2f} |"
    )


def _rounds_row(runs: list[dict]) -> str:
    """Medians over the alternating rounds (guidellm against ours), then every run in order."""
    tps = [_median_of(runs, c, "output_tokens_per_s") for c in ("guidellm", "ours")]
    ttft = [_median_of(runs, c, "ttft_p50_s") for c in ("guidellm", "ours")]
    each = "; ".join(f"{r['client']} {r['output_tokens_per_s']:.0f} tok/s {1e3 * r['ttft_p50_s']:.1f} ms" for r in runs)
    return (
        f"|  | medians of {len(runs) // 2} rounds, guidellm vs ours | {tps[0]:.0f} vs {tps[1]:.0f} "
        f"({100 * (tps[0] / tps[1] - 1):+.1f} %) | | p50 {1e3 * ttft[0]:.1f} vs {1e3 * ttft[1]:.1f} "
        f"({100 * (ttft[0] / ttft[1] - 1):+.1f} %) | | | | | runs: {each} |"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
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
    args = p.parse_args(argv)
    args.workloads = [Workload.parse(w) for w in (args.workload or ["64:64:64:32"])]
    args.endpoints = [e for e in args.endpoints.split(",") if e]
    if any("=" not in e for e in args.serve_env):
        p.error("--serve-env takes NAME=VALUE")
    args.serve_env = dict(e.split("=", 1) for e in args.serve_env)
    if not set(args.endpoints) <= set(ENDPOINTS):
        p.error(f"--endpoints: choose from {sorted(ENDPOINTS)}")
    args.serve_args = [
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
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = args.model_dir or os.path.join("/tmp", "serving_bench", args.model)
    t0 = time.perf_counter()
    model_path = write_model(args.model, model_dir, args.nano_experts, args.device, args.load_format)
    print(f"model {model_path} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    cases = make_cases(model_path, args.workloads, args.endpoints, args.seed)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a timeout's SIGTERM still stops the server tree (`with`)
    served: dict[str, dict] = {}
    inproc: dict[str, dict] = {}
    try:
        if args.inprocess_first and not args.skip_inprocess:
            inproc = run_inprocess(args, model_path, cases)
        if not args.skip_served:
            try:
                run_served(args, model_path, cases, served)
            except RuntimeError as exc:  # the server did not come up: keep the in-process numbers
                print(f"served run failed: {exc}", flush=True)
                served["_error"] = {"message": str(exc)}
        if not args.skip_inprocess and not args.inprocess_first:
            inproc = run_inprocess(args, model_path, cases)
    finally:  # also when cut short: whatever finished is reported
        print("\n".join(report(served, inproc, cases)), flush=True)
        if args.out:
            write_json(args.out, args, served, inproc)
    errors = sum(r["summary"]["num_errors"] for r in served.values() if "summary" in r)
    return 2 if "_error" in served else 1 if errors else 0


def write_json(path: str, args: argparse.Namespace, served: dict, inproc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(
            {"args": {k: v for k, v in vars(args).items() if k != "workloads"}, "served": served, "in_process": inproc},
            f,
            indent=2,
            default=str,
        )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
