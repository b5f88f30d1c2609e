"""CPU: what one new prompt's prefill costs a step of decoding requests (the served engine's common step).

Served requests arrive one at a time, so most served steps carry one new prompt's prefill beside the requests that
decode; the in-process closed loop refills its whole batch in one step. This benchmark runs the engine in this
process with `--decodes` requests decoding (long outputs, ignore_eos), then alternates two kinds of step:
- a decode-only step (the decoding requests, one new token each);
- a mixed step: the same requests plus `--prefills` new prompts of `--prefill-len` tokens (each asks for one
  output token, so it prefills and finishes in that step).
With `--split both` each round runs the mixed step twice, once with the bundle's `mamba_decode_split` on (the
one-token rows by the decode recurrence, the prefill by the varlen scan) and once off (every row by the varlen
scan), so the A/B shares the machine's state; `on` / `off` run one of them, `bundle` the bundle's own setting.
It prints the median wall and thread-CPU time of each kind (one torch thread: the thread CPU time is the work,
the wall time adds whatever else ran on the machine), and their difference: the prefill's price in a step.
The engine is the S1 benchmark's (the tiny model, page 64, token budget 8192, prefix cache off) with
async scheduling off, so each `Engine.step` runs exactly the step it schedules.

    PYTHONPATH=. python benchmarks/mixed_step_bench.py [--kernel-backend native] [--decodes 31] [--prefill-len 64]
        [--prefills 1] [--split both]
    PYTHONPATH=. python benchmarks/mixed_step_bench.py --profile 25   # cProfile of the mixed steps, top 25
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import tempfile
import time

import torch

from service.engine import Engine, EngineConfig, SamplingParams


def make_engine(model_dir: str, backend: str, decodes: int, prefills: int) -> Engine:
    return Engine(
        EngineConfig(
            model_path=model_dir,
            device="cpu",
            dtype="float32",
            kernel_backend=backend,
            page_size=64,
            max_num_seqs=max(256, decodes + prefills),
            max_num_batched_tokens=8192,
            mamba_cache_strategy="off",
            async_scheduling=False,
        )
    )


def timed_step(engine: Engine) -> tuple[float, float]:
    """(wall ms, thread CPU ms) of one `Engine.step`."""
    w0, c0 = time.perf_counter(), time.thread_time()
    engine.step()
    return (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3


def run(args: argparse.Namespace, model_dir: str) -> dict[str, list[tuple[float, float]]]:
    """Per step kind, the (wall ms, CPU ms) of each timed step."""
    engine = make_engine(model_dir, args.kernel_backend, args.decodes, args.prefills)
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(args.decodes):
        engine.add_request(prompt(args.decode_prompt_len), long)
    engine.step()  # their prefill
    for _ in range(args.warmup):
        engine.step()
    bundle = engine.runner.model.kernels
    modes = {"on": [True], "off": [False], "both": [True, False], "bundle": [bundle.mamba_decode_split]}[args.split]
    kinds = {True: "mixed, split", False: "mixed, varlen"}
    times: dict[str, list[tuple[float, float]]] = {"decode-only": [], **{kinds[m]: [] for m in modes}}
    prof = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        for split in modes:
            engine.runner.model.kernels = dataclasses.replace(bundle, mamba_decode_split=split)
            times["decode-only"].append(timed_step(engine))
            for _ in range(args.prefills):
                engine.add_request(prompt(args.prefill_len), one)
            if prof is not None:
                prof.enable()
            times[kinds[split]].append(timed_step(engine))
            if prof is not None:
                prof.disable()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel-backend", default="native", choices=("native", "torch"))
    ap.add_argument("--decodes", type=int, default=31, help="requests decoding in every step")
    ap.add_argument("--decode-prompt-len", type=int, default=64, help="prompt tokens of the decoding requests")
    ap.add_argument("--prefills", type=int, default=1, help="new prompts in each mixed step")
    ap.add_argument("--prefill-len", type=int, default=64, help="tokens of each new prompt")
    ap.add_argument("--steps", type=int, default=40, help="timed steps of each kind (alternating)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the served replica runs 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None, help="a model folder (default: the embedded tiny model, written)")
    ap.add_argument(
        "--split",
        default="both",
        choices=("both", "on", "off", "bundle"),
        help="the mixed steps' mamba_decode_split: both (alternating), on, off, or the bundle's own",
    )
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions of the mixed steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from service.testing import tiny  # noqa: PLC0415

            model_dir = tiny.make_tiny_model(os.path.join(tmp, "tiny"))
        times = run(args, model_dir)
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print(
        f"backend {args.kernel_backend}, {args.decodes} decoding + {args.prefills} x {args.prefill_len}-token "
        f"prefill, {args.steps} steps each, load {os.getloadavg()[0]:.1f}"
    )
    base_wall, base_cpu = med["decode-only"]
    for kind, (wall, cpu) in med.items():
        price = "" if kind == "decode-only" else f"  (+{wall - base_wall:.2f} / +{cpu - base_cpu:.2f} ms: the prefill)"
        print(f"  {kind:14s} median {wall:7.2f} ms wall, {cpu:7.2f} ms CPU{price}")


if __name__ == "__main__":
    main()
