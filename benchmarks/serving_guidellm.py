"""The independent-client cross-check of `serving_bench` (`--guidellm`): guidellm (PyPI) against the same server on
the same workload shape, alternated with our client for `--guidellm-rounds`."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

from benchmarks.serving_cases import Case, Workload
from benchmarks.serving_client import closed_loop_clients
from benchmarks.serving_procs import ServeProcess
from loadtests.bench_client import Summary


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
        runs.append(_our_run(ours))
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


def _our_run(ours: Summary) -> dict:
    """One run of our client as a round's entry (TTFT p50 to the first text, guidellm's definition)."""
    return {
        "client": "ours",
        "output_tokens_per_s": ours.output_tokens_per_s,
        "ttft_p50_s": (ours.ttft_text or ours.ttft)["p50"],
        "ttft_token_p50_s": ours.ttft["p50"],
        "errors": ours.num_errors,
        "load_avg_1m": os.getloadavg()[0],
    }


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


def run_guidellm(server: ServeProcess, w: Workload, model_path: str, timeout_s: float, data: str | None = None) -> dict:
    """The same workload shape from guidellm (its own client; its own synthetic prompts, or the JSONL file `data`)
    against the same server: output tok/s and TTFT p50 as guidellm reports them."""
    path = os.path.join(server.tmp, "guidellm.json")
    cmd = _guidellm_command(server, w, model_path, data, path)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=_guidellm_env(server), cwd=server.tmp
    )
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


def _guidellm_command(server: ServeProcess, w: Workload, model_path: str, data: str | None, path: str) -> list[str]:
    """`python -m guidellm run` of the workload against the server, its JSON results written to `path`."""
    backend = {
        "kind": "openai_http",
        "target": server.base_url.removesuffix("/v1"),
        "model": server.model,
        "request_format": "/v1/completions",
        "http2": False,
        "extras": {"body": {"ignore_eos": True, "temperature": 0.0}},
    }
    return [
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


def _guidellm_env(server: ServeProcess) -> dict[str, str]:
    """guidellm's environment: one client process that does not spin (its defaults: up to 10 workers polling every
    0.1 ms, which on a small machine take the server's CPU); its log file goes to the server's temp dir."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "GUIDELLM__DEFAULT_ASYNC_LOOP_SLEEP": "0.001",
        "GUIDELLM__LOGGING__LOG_FILE": os.path.join(server.tmp, "guidellm.log"),
    }
