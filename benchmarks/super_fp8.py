"""Super 120B-A12B in ModelOpt FP8 with an FP8 KV cache, dummy weights, on one GPU: load, memory plan, decode at
batch 1 and 64, and a closed-loop ISL/OSL run at the highest concurrency the memory plan allows.

    PYTHONPATH=. python3 benchmarks/super_fp8.py --out super_fp8.md            # the H200 run (~4-5 min)
    PYTHONPATH=. python3 benchmarks/super_fp8.py --device cpu --shrink ...     # the same flow on CPU, small shapes

The weights are drawn on the device straight into their final dtypes (model/dummy.py: e4m3 experts and Mamba
GEMMs, BF16 attention / latent projections / embeddings, fp32 router; no BF16 copy of an FP8 tensor); the script
reports the allocator's peak while drawing next to the weights' bytes. The concurrency is the largest C for which
the engine's memory plan (runner/memory_plan.py: weights, a profiling forward at the token budget, the CUDA-graph
reserve of C rows) gives C Mamba live slots and KV pages for C requests of ISL + OSL tokens; the engine then runs
with max_num_seqs = C and every request of the closed loop in flight at once.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time

import torch

from benchmarks.engine_bench import decode_tps, random_prompts, sync
from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.config import ModelConfig
from service.engine.runner import memory_plan
from service.engine.runner.model_runner import build_model, resolve_kv_dtype, resolve_ssm_dtype, state_shapes
from service.engine.runner.state_tensors import StateTensors
from service.testing.model_dir import make_model_dir, published_config

GiB = 1 << 30


def shrunk_overrides(config: str, per_kind: int, experts: int, narrow: int) -> dict:
    """config.json keys that keep `per_kind` layers of each layer kind (in order of first appearance), `experts`
    routed experts (top-k capped at 4), a 2K vocabulary, and divide the widths by `narrow`: the CPU flow check."""
    cfg = published_config(config)
    pattern = cfg["hybrid_override_pattern"]
    kinds = sorted(set(pattern), key=pattern.index)
    out = {"hybrid_override_pattern": "".join(k for _ in range(per_kind) for k in kinds)}
    out.update(num_hidden_layers=len(out["hybrid_override_pattern"]), vocab_size=2048, n_routed_experts=experts)
    out["num_experts_per_tok"] = min(4, cfg["num_experts_per_tok"])
    for key in ("hidden_size", "mamba_num_heads", "num_attention_heads", "intermediate_size", "moe_intermediate_size"):
        out[key] = cfg[key] // narrow
    for key in ("moe_shared_expert_intermediate_size", "moe_latent_size"):
        if cfg.get(key):
            out[key] = cfg[key] // narrow
    return out


def engine_config(args: argparse.Namespace, model_dir: str, max_num_seqs: int) -> EngineConfig:
    return EngineConfig(
        model_path=model_dir,
        device=args.device,
        dtype="bfloat16" if args.device.startswith("cuda") else "float32",
        page_size=args.page_size,
        mamba_cache_strategy="off",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=args.isl + args.osl + 64,
        load_format="dummy",
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype="auto",  # the checkpoint's: FP8
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
    )


def max_concurrency(args: argparse.Namespace, model_dir: str, model, model_cfg: ModelConfig, upper: int) -> int:
    """The largest C <= upper whose memory plan (`memory_plan.plan_for`, as the engine computes it with
    max_num_seqs = C) holds C live Mamba slots and KV pages for C requests of ISL + OSL tokens; 0 if none."""
    need_pages = math.ceil((args.isl + args.osl) / args.page_size)
    device = torch.device(args.device)

    def fits(c: int) -> bool:
        cfg = engine_config(args, model_dir, c).resolved()
        kv_dtype, ssm_dtype = resolve_kv_dtype(cfg, torch.bfloat16), resolve_ssm_dtype(cfg, model_cfg)
        shapes = state_shapes(model_cfg, model.shapes)

        def new_pools(sizes):
            return StateTensors(sizes, cfg.page_size, shapes, torch.bfloat16, device, kv_dtype, ssm_dtype=ssm_dtype)

        try:
            plan = memory_plan.plan_for(
                cfg, model_cfg, model, cfg.max_model_len, torch.bfloat16, new_pools, kv_dtype, ssm_dtype
            )
        except ValueError:
            return False
        return plan.num_kv_pages >= c * need_pages

    lo, hi = 0, upper  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def closed_loop(
    engine: Engine, num_prompts: int, isl: int, osl: int, concurrency: int, limit_s: float = math.inf
) -> dict[str, float]:
    """At most `concurrency` requests in flight (the next sent when one finishes), until all are done or limit_s
    seconds have passed: output tok/s (tokens generated / elapsed), TTFT and TPOT medians (ms; a request still
    running counts its tokens so far) and the most requests that ran in one step."""
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    pending = random_prompts(num_prompts, isl, engine.model_config.vocab_size, seed=7)[::-1]
    sent, first, last, reached = {}, {}, {}, 0
    tokens0 = engine.num_generation_tokens
    sync(engine.config.device)
    t0 = time.perf_counter()
    while (pending or engine.has_unfinished()) and time.perf_counter() - t0 < limit_s:
        while pending and len(engine.requests) < concurrency:
            sent[engine.add_request(pending.pop(), params)] = time.perf_counter()
        outs = engine.step()
        reached = max(reached, len(engine.scheduler.running))
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = (now, o.num_output_tokens)
    elapsed = time.perf_counter() - t0
    ttft = sorted(first[r] - sent[r] for r in first)
    tpot = sorted((last[r][0] - first[r]) / (last[r][1] - 1) for r in first if last[r][1] > 1)
    finished = sum(1 for r in sent if r not in engine.requests)
    for rid in list(engine.requests):
        engine.abort(rid)
    return {
        "output tok/s": (engine.num_generation_tokens - tokens0) / elapsed,
        "TTFT median ms": 1e3 * ttft[len(ttft) // 2] if ttft else math.nan,
        "TPOT median ms": 1e3 * tpot[len(tpot) // 2] if tpot else math.nan,
        "concurrency reached": float(reached),
        "requests finished": float(finished),
        "seconds": elapsed,
    }


def load(args: argparse.Namespace, model_dir: str):
    """The dummy FP8 model on the device: (model, lines reporting load time, weight bytes and the load's peak)."""
    model_cfg = ModelConfig.from_model_path(model_dir)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    cfg = engine_config(args, model_dir, 1)
    model = build_model(cfg, model_cfg, torch.bfloat16 if cuda else torch.float32, torch.device(args.device))
    sync(args.device)
    weights = memory_plan.weights_bytes(model)
    by_dtype: dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + p.numel() * p.element_size()
    lines = [
        f"dummy weights drawn in {time.perf_counter() - t0:.1f} s: {weights / GiB:.2f} GiB "
        f"({', '.join(f'{k} {v / GiB:.2f} GiB' for k, v in sorted(by_dtype.items()))})"
    ]
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        lines.append(f"allocator peak while drawing {peak / GiB:.2f} GiB (weights + {(peak - weights) / GiB:.2f} GiB)")
    return model, model_cfg, lines


def run(args: argparse.Namespace, model_dir: str) -> list[str]:
    lines: list[str] = []

    def say(text: str) -> None:  # printed, and the report rewritten (a run cut short keeps its lines)
        lines.append(text)
        print(text, flush=True)
        if args.out:
            write_report(args, lines)

    model, model_cfg, load_lines = load(args, model_dir)
    for line in load_lines:
        say(line)
    if args.device.startswith("cuda"):
        c = max_concurrency(args, model_dir, model, model_cfg, args.max_concurrency)
        say(f"highest concurrency the memory plan allows for {args.isl}/{args.osl}: {c}")
    else:
        c = args.max_concurrency
        say(f"CPU: no memory plan; concurrency {c} as given")
    if c < 1:
        raise SystemExit("the model does not fit with one request: " + "; ".join(lines))
    engine = Engine(engine_config(args, model_dir, max(c, *args.decode_batches)), model=model)
    kv = engine.runner.pools.kv
    say(f"KV pool {tuple(kv.shape)} {kv.dtype}; max_num_seqs {engine.config.max_num_seqs}")
    if engine.runner.memory_plan is not None:
        say(engine.runner.memory_plan.log_line())
    for b in args.decode_batches:
        tps, _ = decode_tps(engine, b, args.prompt_len, args.decode_steps, 1000 + b)
        say(f"decode B={b}: {tps:.1f} tok/s ({1e3 * b / tps:.2f} ms/step)")
    closed_loop(engine, min(4, c), args.isl, 8, min(4, c))  # warm-up: the mixed prefill + decode step shapes
    r = closed_loop(engine, args.prompts or c, args.isl, args.osl, c, args.limit_s)
    say(
        f"{args.isl}/{args.osl} x {args.prompts or c} prompts at concurrency {c}"
        f"{f' (stopped after {args.limit_s:.0f} s)' if r['seconds'] >= args.limit_s else ''}: "
        + ", ".join(f"{k} {v:.1f}" for k, v in r.items())
    )
    return lines


def write_report(args: argparse.Namespace, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(f"# {args.config} FP8 (dummy weights, FP8 KV cache) on {args.device}\n\n")
        f.write("".join(f"- {line}\n" for line in lines))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="super", help="'super', 'nano' or an HF config.json path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.95)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--decode-batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each decode request")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=0, help="closed-loop prompts; 0: one per concurrency slot")
    ap.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the SSM state pools (bfloat16: half of each request's Mamba slot, so more concurrency fits)",
    )
    ap.add_argument("--limit-s", type=float, default=math.inf, help="stop the closed loop after this many seconds")
    ap.add_argument("--max-concurrency", type=int, default=256, help="upper bound of the search (CPU: the value)")
    ap.add_argument(
        "--shrink",
        default="",
        help="PER_KIND,EXPERTS,NARROW: layers of each kind, routed experts, width divisor (the CPU flow check)",
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    return args


def main() -> None:
    args = parse_args()
    overrides = shrunk_overrides(args.config, *map(int, args.shrink.split(","))) if args.shrink else None
    model_dir = tempfile.mkdtemp(prefix="super_fp8_")
    try:
        make_model_dir(model_dir, args.config, "fp8", kv_cache_fp8=True, overrides=overrides)
        run(args, model_dir)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
