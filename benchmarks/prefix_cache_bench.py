"""Shared-prefix workload: N requests sharing a long system prompt, each with a short question.

Runs the same workload with mamba_cache_strategy=off and extra_buffer (and no_buffer when
--page-size 1) in one process and reports end-to-end time, hit tokens and the speed-up ratio.

    .venv/bin/python benchmarks/prefix_cache_bench.py                        # CPU, embedded tiny model
    python benchmarks/prefix_cache_bench.py --device cuda --model-path P     # GPU
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from service.engine import Engine, EngineConfig, SamplingParams


def workload(vocab: int, num_requests: int, system_len: int, question_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_len)]
    return [system + [rng.randrange(3, vocab) for _ in range(question_len)] for _ in range(num_requests)]


def run(args: argparse.Namespace, strategy: str, model=None) -> dict:
    engine = Engine(
        EngineConfig(
            model_path=args.model_path,
            device=args.device,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            mamba_cache_strategy=strategy,
            kernel_backend=args.kernel_backend,
        ),
        model=model,
    )
    prompts = workload(engine.model_config.vocab_size, args.num_requests, args.system_len, args.question_len, 0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up (and the first hit)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    if args.device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    s = engine.stats()
    return {
        "strategy": strategy,
        "seconds": dt,
        "output_tokens": sum(len(o.token_ids) for o in outs),
        "hit_tokens": s["prefix_cache_hit_tokens"],
        "queried_tokens": s["prefix_cache_queried_tokens"],
        "model": engine.runner.model,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: a fresh embedded tiny model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kernel-backend", default="torch")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    if args.model_path is None:
        from service.testing.tiny import make_tiny_model

        args.model_path = make_tiny_model(tempfile.mkdtemp(prefix="hybrid-serve-bench-"))
    strategies = ["off", "extra_buffer"] + (["no_buffer"] if args.page_size == 1 else [])
    results, model = [], None
    for strategy in strategies:
        r = run(args, strategy, model)
        model = r.pop("model")
        results.append(r)
    base = results[0]["seconds"]
    print(f"{'strategy':<14}{'seconds':>10}{'out tok/s':>12}{'hit tokens':>12}{'ratio vs off':>14}")
    for r in results:
        print(
            f"{r['strategy']:<14}{r['seconds']:>10.3f}{r['output_tokens'] / r['seconds']:>12.1f}"
            f"{r['hit_tokens']:>12}{r['seconds'] / base:>14.3f}"
        )


if __name__ == "__main__":
    main()
