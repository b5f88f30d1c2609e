"""The in-process half of `serving_bench`: the same cases through the engine in this process, as a closed loop with
per-request timings as a client would see them."""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from benchmarks.serving_cases import Case, case_key, warmup_count
from benchmarks.serving_procs import own_cpu_seconds
from loadtests.bench_client import RequestResult, Summary, summarize


def run_inprocess(args: argparse.Namespace, model_path: str, cases: list[Case]) -> dict[str, dict]:
    """Every case through one engine built in this process (an untimed warm-up run, then the timed one); the engine
    is shut down before this returns."""
    import torch  # noqa: PLC0415

    from service.engine import Engine  # noqa: PLC0415

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    engine = Engine(engine_config(args, model_path))
    out = {}
    for case in cases:
        closed_loop_engine(
            engine,
            case.engine_prompts[: warmup_count(case, args.warmup_prompts)],
            min(args.warmup_tokens, case.workload.osl),
            case.workload.concurrency,
        )
        out[case_key(case)] = timed_inprocess(engine, case)
    engine.shutdown()  # the device memory goes back before a server (--inprocess-first) builds its engine
    del engine
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def timed_inprocess(engine, case: Case) -> dict:
    """One timed closed loop of `case` in `engine`: its summary, this process' CPU seconds, the engine's steps and
    their wall seconds per phase over the run; prints its line."""
    own0, steps0, split0 = own_cpu_seconds(), engine.num_steps, dict(engine.step_seconds)
    summary = closed_loop_engine(engine, case.engine_prompts, case.workload.osl, case.workload.concurrency)
    steps = max(engine.num_steps - steps0, 1)
    split = {k: engine.step_seconds[k] - split0[k] for k in split0}  # schedule / execute (waits) / update
    out = {
        "summary": asdict(summary),
        "cpu_s": {"engine (this process)": own_cpu_seconds() - own0},
        "steps": steps,
        "step_seconds": split,
    }
    print(
        f"  in-process {case_key(case)}: {summary.output_tokens_per_s:.0f} tok/s; {steps} steps, "
        f"{summary.output_tokens / steps:.1f} outputs/step, {1e3 * summary.duration_s / steps:.2f} ms/step wall "
        f"(host {1e3 * (split['schedule'] + split['update']) / steps:.2f}, "
        f"device wait {1e3 * split['execute'] / steps:.2f})",
        flush=True,
    )
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
