"""CPU: our engine (kernel_backend "native" by default, or "torch") against `transformers` generate on the same
checkpoint, in one process.

The checkpoint is a random NemotronH written by transformers' own `save_pretrained` (hidden 256, pattern
M*EM-ME*MEM*E, 16 experts top-4, 8 mamba heads x 32, vocab 2048). Both sides get the same equal-length random
prompts, fp32, greedy, exactly `new` tokens (eos ignored); the greedy tokens must agree. Each side runs N times per
shape (alternating, so machine noise hits both alike) and its best wall time counts; the engine's prefix cache is
off, so a repeat recomputes everything. Each side's best process CPU time is printed too: on a shared machine the
wall time includes the time other processes held the cores, the CPU time does not (with `--threads 1` it is the
work of the one thread, so its ratio is the steadier one under load).

    PYTHONPATH=. python benchmarks/cpu_vs_transformers.py [--shapes 16x96/32,32x256/64,1x64/64] [--repeats 3]
    PYTHONPATH=. python benchmarks/cpu_vs_transformers.py --profile 16x96/32   # torch.profiler table of the engine
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass

import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.kernels import Kernels, torch_reference_kernels

CONFIG = dict(
    vocab_size=2048,
    hidden_size=256,
    hybrid_override_pattern="M*EM-ME*MEM*E",
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    mamba_num_heads=8,
    mamba_head_dim=32,
    n_groups=2,
    ssm_state_size=64,
    conv_kernel=4,
    chunk_size=64,
    intermediate_size=512,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    moe_shared_expert_intermediate_size=256,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.5,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=4096,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    time_step_limit=(0.0, float("inf")),
    use_conv_bias=True,
)


@dataclass(frozen=True)
class Shape:
    batch: int  # requests
    prompt: int  # prompt tokens per request
    new: int  # generated tokens per request

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'16x96/32' -> Shape(16, 96, 32)."""
        try:
            bp, new = text.split("/")
            b, p = bp.split("x")
            return cls(int(b), int(p), int(new))
        except ValueError:
            raise ValueError(f"shape {text!r} must look like BATCHxPROMPT/NEW, e.g. 16x96/32") from None

    def __str__(self) -> str:
        return f"{self.batch}x{self.prompt}/{self.new}"


def write_checkpoint(out_dir: str, seed: int = 0) -> str:
    """A random NemotronH (every parameter non-trivial) saved by transformers; returns out_dir."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("conv1d.bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "weight" in name and p.dim() >= 2:
                p.normal_(0.0, 0.06)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    model.save_pretrained(out_dir)
    return out_dir


def prompts_for(shape: Shape, vocab: int, seed: int) -> torch.Tensor:
    """[batch, prompt] int64 random token ids in [3, vocab) (no bos/eos/pad ids)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (shape.batch, shape.prompt), generator=g)


@dataclass(frozen=True)
class Timing:
    wall_s: float  # wall-clock seconds
    cpu_s: float  # this process's CPU seconds (user + system, all threads): what the load does not inflate
    #               as much as the wall time when the side runs on one thread


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> Timing:
    wall, cpu = _clock()
    return Timing(wall - start[0], cpu - start[1])


def run_transformers(model, prompts: torch.Tensor, new: int) -> tuple[Timing, list[list[int]]]:
    t0 = _clock()
    with torch.inference_mode():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return _since(t0), out[:, prompts.shape[1] :].tolist()


def run_engine(engine: Engine, prompts: torch.Tensor, new: int) -> tuple[Timing, list[list[int]]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rows = prompts.tolist()
    t0 = _clock()
    outs = engine.generate(rows, params)
    return _since(t0), [list(o.token_ids) for o in outs]


def make_engine(path: str, shape: Shape, reference: bool = False, backend: str = "native") -> Engine:
    """backend: the engine's kernel_backend ("native" or "torch"); reference: the engine runs the all-reference
    bundle (`torch_reference_kernels`) instead."""
    cfg = EngineConfig(
        model_path=path,
        device="cpu",
        dtype="float32",
        kernel_backend=backend,
        max_num_seqs=max(shape.batch, 1),
        max_num_batched_tokens=max(2048, shape.batch * shape.prompt),
        max_model_len=shape.prompt + shape.new + 16,
        mamba_cache_strategy="off",  # a repeat of the same prompts must recompute them, as transformers does
    )
    engine = Engine(cfg)
    if reference:
        engine.runner.model.kernels = torch_reference_kernels()
    return engine


def compare(path: str, shape: Shape, repeats: int, seed: int, reference: bool, backend: str) -> dict:
    """Best-of-`repeats` seconds of each side on the same prompts; raises if the greedy tokens differ."""
    from transformers import NemotronHForCausalLM

    hf = NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, shape, reference, backend)
    prompts = prompts_for(shape, CONFIG["vocab_size"], seed)
    warm = Shape(shape.batch, min(shape.prompt, 8), 2)  # first-call costs (allocator, lazy init) off the clock
    run_transformers(hf, prompts[:, : warm.prompt], warm.new)
    run_engine(engine, prompts[:, : warm.prompt], warm.new)
    hf_times, eng_times = [], []
    hf_tokens = eng_tokens = None
    for _ in range(repeats):
        t, hf_tokens = run_transformers(hf, prompts, shape.new)
        hf_times.append(t)
        t, eng_tokens = run_engine(engine, prompts, shape.new)
        eng_times.append(t)
    mismatched = [i for i, (a, b) in enumerate(zip(hf_tokens, eng_tokens)) if a != b]
    hf_s, eng_s = min(t.wall_s for t in hf_times), min(t.wall_s for t in eng_times)
    hf_cpu, eng_cpu = min(t.cpu_s for t in hf_times), min(t.cpu_s for t in eng_times)
    return dict(
        shape=shape,
        hf_s=hf_s,
        engine_s=eng_s,
        speedup=hf_s / eng_s,
        hf_cpu_s=hf_cpu,
        engine_cpu_s=eng_cpu,
        cpu_speedup=hf_cpu / eng_cpu,
        mismatched_rows=mismatched,
        experts_impl=getattr(hf.config, "_experts_implementation", None),
        attn_impl=getattr(hf.config, "_attn_implementation", None),
    )


def with_op_ranges(kernels: Kernels) -> Kernels:
    """The bundle with each op inside a `torch.profiler.record_function` range named after its field."""

    def wrap(name: str, fn):
        def ranged(*args, **kwargs):
            with torch.profiler.record_function(f"op::{name}"):
                return fn(*args, **kwargs)

        return ranged

    return dataclasses.replace(
        kernels,
        **{
            f.name: wrap(f.name, getattr(kernels, f.name))
            for f in dataclasses.fields(kernels)
            if callable(getattr(kernels, f.name))
        },
    )


def profile_engine(path: str, shape: Shape, seed: int, rows: int, backend: str) -> None:
    """Profiles one engine run (after a warm-up run): op ranges first (per bundle op), then aten ops."""
    engine = make_engine(path, shape, backend=backend)
    model = engine.runner.model
    model.kernels = with_op_ranges(model.kernels)
    prompts = prompts_for(shape, CONFIG["vocab_size"], seed)
    run_engine(engine, prompts, shape.new)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t, _ = run_engine(engine, prompts, shape.new)
    print(f"engine {shape}: {t.wall_s:.3f} s under the profiler")
    averages = prof.key_averages()
    ranges = [e for e in averages if e.key.startswith("op::")]
    total = sum(e.cpu_time_total for e in ranges)
    print(f"bundle ops: {total / 1e3:.1f} ms of {t.wall_s * 1e3:.1f} ms wall")
    for e in sorted(ranges, key=lambda e: -e.cpu_time_total):
        print(f"  {e.key:40s} {e.cpu_time_total / 1e3:9.1f} ms {e.count:7d} calls")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x96/32,32x256/64,1x64/64", help="BATCHxPROMPT/NEW, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="runs per side and shape; the best counts")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed")
    ap.add_argument("--checkpoint", default=None, help="folder for the checkpoint (default: a temporary folder)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    ap.add_argument(
        "--kernel-backend",
        default="native",
        choices=("native", "torch"),
        help="the engine's kernel_backend: native (compiled C decode kernels) or torch",
    )
    ap.add_argument(
        "--reference-kernels",
        action="store_true",
        help="the engine runs the all-reference bundle (the *_ref kernels), for an A/B",
    )
    ap.add_argument("--profile", default=None, metavar="SHAPE", help="profile the engine on one shape instead")
    ap.add_argument("--profile-rows", type=int, default=30)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    if args.checkpoint is None:
        tmp = tempfile.TemporaryDirectory(prefix="cpu_vs_hf_")
        args.checkpoint = tmp.name
    path = write_checkpoint(args.checkpoint)
    if args.profile:
        profile_engine(path, Shape.parse(args.profile), args.seed, args.profile_rows, args.kernel_backend)
        return
    results = [
        compare(path, Shape.parse(s), args.repeats, args.seed, args.reference_kernels, args.kernel_backend)
        for s in args.shapes.split(",")
    ]
    bundle = "all-reference" if args.reference_kernels else args.kernel_backend
    print(
        f"engine kernels: {bundle}; torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats}, "
        f"transformers experts={results[0]['experts_impl']} attention={results[0]['attn_impl']}"
    )
    print(f"load average (1, 5, 15 min): {', '.join(f'{v:.1f}' for v in os.getloadavg())} on {os.cpu_count()} cores")
    print(
        "| batch x prompt / new | transformers generate (s) | engine (s) | engine speed-up "
        "| transformers CPU (s) | engine CPU (s) | CPU-time speed-up | greedy tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    bad = []
    for r in results:
        ok = "equal" if not r["mismatched_rows"] else f"DIFFER in rows {r['mismatched_rows']}"
        print(
            f"| {r['shape']} | {r['hf_s']:.3f} | {r['engine_s']:.3f} | {r['speedup']:.2f}x "
            f"| {r['hf_cpu_s']:.3f} | {r['engine_cpu_s']:.3f} | {r['cpu_speedup']:.2f}x | {ok} |"
        )
        if r["mismatched_rows"]:
            bad.append(str(r["shape"]))
    if bad:
        raise SystemExit(f"greedy tokens differ from transformers on {', '.join(bad)}")


if __name__ == "__main__":
    main()
