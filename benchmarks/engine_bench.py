"""Engine benchmark: the Nano-30B-A3B (or Super, or any) config with dummy weights drawn on the GPU
(`load_format="dummy"`), in BF16 and/or ModelOpt FP8 (`--formats bf16,fp8`), per engine variant.

Variants: `torch`, `triton` (eager steps), `triton+graphs` (decode-only steps replayed from CUDA graphs; a mixed
step replays its plain decode rows and runs the rest eagerly) and `triton+graphs+nosplit` (mixed steps all eager).
Reports prefill tokens/s at ISL 1K and 8K (whole requests, max_tokens=1, token budget 8192 per step), decode
tokens/s at concurrency 1, 64, 256 (prompts of --prompt-len tokens, timed over pure decode steps), a random-prompt
throughput run (--tp-isl in / --tp-osl out, ignore_eos, at most --tp-concurrency requests in flight: a request is
sent when one finishes; output tok/s, TTFT and TPOT medians), and the decode weight-bandwidth limit at batch 1
(active bytes per step / measured copy bandwidth) with each variant's fraction of it.
One model per format is built (`build_model` with load_format="dummy": the weights are drawn on the device in their
final dtypes) and shared by the variants; `model.kernels` is rebound to each variant's bundle (the Engine takes the
model as given).

    PYTHONPATH=. python benchmarks/engine_bench.py [--variants triton,triton+graphs] [--out engine.md]
CPU smoke run (tiny config, interpreter): TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/engine_bench.py \
    --device cpu --config <tiny config.json> --variants torch,triton --isl 40,70 --decode-batches 1,3 \
    --prompt-len 20 --decode-steps 2 --tp-prompts 4 --tp-concurrency 2 --tp-isl 16 --tp-osl 4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time

import torch

from benchmarks import roofline, step_split
from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.config import ModelConfig
from service.engine.kernels import Kernels, get_kernels
from service.engine.model.quant import QuantConfig
from service.engine.runner.model_runner import build_model
from service.testing.model_dir import fp8_exclusions, published_config


def write_model_dir(config: str, fmt: str) -> str:
    """A temporary folder with the config.json of `config` ('nano', 'super' or a path) and, for fmt 'fp8', a ModelOpt
    FP8 hf_quant_config.json with the published recipe's exclusions: the engine draws dummy weights from it."""
    model_dir = tempfile.mkdtemp(prefix=f"engine_bench_{fmt}_")
    cfg = published_config(config)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    if fmt == "fp8":
        with open(os.path.join(model_dir, "hf_quant_config.json"), "w") as f:
            json.dump(QuantConfig("FP8", None, fp8_exclusions(cfg)).to_hf_quant_config(), f)
    return model_dir


def active_bytes_per_token(model: torch.nn.Module, model_cfg: ModelConfig) -> float:
    """Weight bytes one decode step at batch 1 must read: all but the embedding table, top_k of E experts."""
    total = expert = 0.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embeddings" in name:
            continue
        if ".experts." in name:
            expert += nbytes
        else:
            total += nbytes
    return total + expert * model_cfg.num_experts_per_tok / model_cfg.n_routed_experts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def prefill_tps(engine: Engine, isl: int, num_reqs: int, seed: int) -> float:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate(random_prompts(num_reqs, isl, vocab, seed), params)  # warm-up: compiles this step shape's kernels
    prompts = random_prompts(num_reqs, isl, vocab, seed + 1)
    sync(engine.config.device)
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    sync(engine.config.device)
    return isl * num_reqs / (time.perf_counter() - t0)


def step_phases(engine: Engine) -> tuple[int, dict[str, float]]:
    return engine.num_steps, dict(engine.step_seconds)


def phase_ms(engine: Engine, before: tuple[int, dict[str, float]], prefix: str) -> dict[str, float]:
    """Mean host milliseconds per step in each engine phase since `before` ("execute" includes device waits)."""
    n = max(engine.num_steps - before[0], 1)
    return {f"{prefix} {k} ms/step": 1e3 * (v - before[1][k]) / n for k, v in engine.step_seconds.items()}


def decode_tps(
    engine: Engine,
    batch: int,
    prompt_len: int,
    steps: int,
    seed: int,
    trace_dir: str = "",
    ceilings: tuple[float, float] | None = None,
    notes: list[str] | None = None,
) -> tuple[float, dict[str, float]]:
    """(decode tok/s over `steps` pure decode steps at `batch`, host ms per step by engine phase and, with graphs,
    the device ms of a replay on the last step's real inputs). trace_dir: also write a CPU+CUDA trace of 5 steps.
    ceilings (bandwidth GB/s, bf16 TFLOP/s): also profile 5 steps (the split covers the last 4) and add their
    per-step time split and the step's bound (`step_split`) to the results and, as text, to notes."""
    vocab = engine.model_config.vocab_size
    # the first requests decode while the last ones prefill: enough tokens that nobody ends before the timed steps
    prefill_steps = -(-batch * prompt_len // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=prefill_steps + steps + 16, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(batch, prompt_len, vocab, seed)]
    while any(not engine.requests[i].output_token_ids for i in ids):  # prefill everyone
        engine.step()
    for _ in range(3):  # warm-up decode steps
        engine.step()
    sync(engine.config.device)
    phases0, ahead0 = step_phases(engine), engine.num_steps_ahead
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.config.device)
    elapsed = time.perf_counter() - t0
    phases = phase_ms(engine, phases0, f"decode B={batch}")
    phases[f"decode B={batch} steps launched ahead"] = float(engine.num_steps_ahead - ahead0)
    g = engine.runner.graphs
    if g is not None:
        phases[f"decode B={batch} replay ms (real inputs)"] = replay_ms(engine, g.bucket_for(batch))
    if trace_dir:
        profile_steps(engine, os.path.join(trace_dir, f"trace_decode_b{batch}.json"))
    if ceilings is not None:
        phases.update(decode_split(engine, batch, prompt_len + steps + 8, ceilings, notes))
    assert all(i in engine.requests for i in ids), "a decode request ended before the measurement did"
    for i in ids:
        engine.abort(i)
    return batch * steps / elapsed, phases


def decode_split(
    engine: Engine, batch: int, context: int, ceilings: tuple[float, float], notes: list[str] | None
) -> dict[str, float]:
    """Profiles 4 decode steps of the running batch: device ms per kernel family, device busy and host gaps per step,
    and the step's bound at `context` tokens per request (`step_split.decode_bound`)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profile_steps(engine, path)
        split = step_split.split_trace_file(path)
        g = engine.runner.graphs
        eager = None
        if g is not None and split.kernels_per_step < 50:  # the profiler did not see inside the graph replays
            eager = os.path.join(tmp, "eager.json")
            profile_eager_forward(engine, g.bucket_for(batch), eager)
            eager = step_split.split_trace_file(eager)
    bound = step_bound(engine, batch, context, ceilings)
    lines = step_split.split_lines(split, bound)
    if eager is not None:
        lines.append(
            f"  kernels inside graph replays were not traced: device ms per family of one eager forward of the same "
            f"inputs: {', '.join(f'{k} {v:.2f}' for k, v in eager.family_ms.items())} (busy {eager.busy_ms:.2f})"
        )
        split = dataclasses.replace(split, family_ms=eager.family_ms)
    print("\n".join(lines), flush=True)
    if notes is not None:
        notes.extend(lines)
    key = f"decode B={batch} split"
    out = {
        f"{key} wall ms": split.wall_ms,
        f"{key} device busy ms": split.busy_ms,
        f"{key} host gaps ms": split.idle_ms,
    }
    out.update({f"{key} {fam} ms": ms for fam, ms in split.family_ms.items()})
    out[f"{key} bound (sum) ms"] = bound.sum_ms
    return out


def step_bound(engine: Engine, batch: int, context: int, ceilings: tuple[float, float]) -> step_split.StepBound:
    """The bound of one decode step of this engine's model and pools at `batch` (see `step_split.decode_bound`)."""
    model, cfg, pools = engine.runner.model, engine.model_config, engine.runner.pools
    dense = expert = 0.0
    elem = 2.0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if "embeddings" in name:
            continue
        if ".experts." in name:
            expert += nbytes
            elem = p.element_size()
        else:
            dense += nbytes
    slots = pools.ssm.shape[1]
    slot_bytes = (pools.conv.numel() * pools.conv.element_size() + pools.ssm.numel() * pools.ssm.element_size()) / slots
    kv_token_bytes = pools.kv.numel() * pools.kv.element_size() / pools.kv.shape[2]
    bw, tflops = ceilings
    return step_split.decode_bound(
        batch,
        dense,
        expert,
        elem,
        cfg.num_experts_per_tok,
        cfg.n_routed_experts,
        slot_bytes,
        kv_token_bytes,
        context,
        bw,
        tflops,
    )


def throughput_run(
    engine: Engine,
    num_prompts: int,
    isl: int,
    osl: int,
    concurrency: int,
    seed: int,
    trace_at: tuple[int, ...] = (),
    notes: list[str] | None = None,
    progress_every: int = 256,
) -> dict[str, float]:
    """Closed loop: at most `concurrency` requests in flight, the next one sent when one finishes.
    Returns output tok/s over the whole run, TTFT / TPOT medians (ms; TTFT from the request's send) and the host
    wall time per step by kind: mixed steps (a graph part and an eager part), steps launched ahead (async
    scheduling) and the others. trace_at: step indices from which 5 steps are profiled (the split covers the last 4:
    device busy, host gaps and device ms per kernel family, printed and added to notes); progress_every: steps
    between progress lines."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    pending = random_prompts(num_prompts, isl, vocab, seed)[::-1]
    sent, first, done = {}, {}, {}
    split0 = engine.runner.num_split_steps
    ahead0, prefill_ahead0 = engine.num_steps_ahead, engine.num_prefill_steps_ahead
    phases0 = step_phases(engine)
    kinds = {k: [0, 0.0, 0] for k in ("mixed", "ahead", "other")}  # kind -> [steps, seconds, sampled rows]
    traces: dict[int, step_split.StepSplit] = {}
    prof, step, tmp = None, 0, tempfile.mkdtemp(prefix="tp_trace_")
    sync(engine.config.device)
    t0 = time.perf_counter()
    while pending or len(done) < len(sent):
        while pending and len(sent) - len(done) < concurrency:
            sent[engine.add_request(pending.pop(), params)] = time.perf_counter()
        if step in trace_at and prof is None:
            prof, traced_from = _start_profile(), step
        split_before, ahead_before, ts = engine.runner.num_split_steps, engine.num_steps_ahead, time.perf_counter()
        with torch.profiler.record_function(step_split.STEP_RANGE):
            outs = engine.step()
        now = time.perf_counter()
        kind = (
            "mixed"
            if engine.runner.num_split_steps > split_before
            else "ahead"
            if engine.num_steps_ahead > ahead_before
            else "other"
        )
        rec = kinds[kind]
        rec[0], rec[1], rec[2] = rec[0] + 1, rec[1] + now - ts, rec[2] + len(outs)
        step += 1
        if step % progress_every == 0:  # a run cut by a timeout still shows how far it got
            n_out = sum(r[2] for r in kinds.values())
            ahead, prefill = engine.num_steps_ahead - ahead0, engine.num_prefill_steps_ahead - prefill_ahead0
            print(
                f"  tp progress: step {step}, {now - t0:.1f} s, {n_out} outputs, {len(done)} done, {ahead} steps "
                f"launched ahead ({prefill} with a prefill chunk)",
                flush=True,
            )
        if prof is not None and step == traced_from + 5:
            traces[traced_from] = _stop_profile(prof, engine, os.path.join(tmp, f"tp_{traced_from}.json"))
            prof = None
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
    elapsed = time.perf_counter() - t0
    if prof is not None:
        traces[traced_from] = _stop_profile(prof, engine, os.path.join(tmp, f"tp_{traced_from}.json"))
    shutil.rmtree(tmp, ignore_errors=True)
    ttft = sorted(first[r] - sent[r] for r in sent)
    tpot = sorted((done[r] - first[r]) / (osl - 1) for r in sent) if osl > 1 else [0.0]
    out = {
        "tp output tok/s": num_prompts * osl / elapsed,
        "tp TTFT median ms": 1e3 * ttft[len(ttft) // 2],
        "tp TPOT median ms": 1e3 * tpot[len(tpot) // 2],
        "tp seconds": elapsed,
        "tp split steps": float(engine.runner.num_split_steps - split0),
        "tp steps": float(engine.num_steps - phases0[0]),
        "tp steps launched ahead": float(engine.num_steps_ahead - ahead0),
        "tp prefill steps launched ahead": float(engine.num_prefill_steps_ahead - prefill_ahead0),
        **phase_ms(engine, phases0, "tp"),
    }
    for kind, (n, sec, rows) in kinds.items():
        out[f"tp {kind} steps"] = float(n)
        out[f"tp {kind} seconds"] = sec
        out[f"tp {kind} ms/step"] = 1e3 * sec / max(n, 1)
        out[f"tp {kind} outputs/step"] = rows / max(n, 1)
    for at, split in traces.items():
        line = step_split.split_lines(split, None)[0].replace("- decode B=?", f"- throughput steps {at + 1}..{at + 4}")
        print(line, flush=True)
        if notes is not None:
            notes.append(line)
        out[f"tp steps {at}+ device busy ms"] = split.busy_ms
        out[f"tp steps {at}+ host gaps ms"] = split.idle_ms
    return out


def _start_profile() -> torch.profiler.profile:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.__enter__()
    return prof


def _stop_profile(prof: torch.profiler.profile, engine: Engine, path: str) -> step_split.StepSplit:
    sync(engine.config.device)
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(path)
    return step_split.split_trace_file(path)


def replay_ms(engine: Engine, bucket: int, n: int = 20) -> float:
    """Device ms of one replay of a bucket's graph on whatever its static inputs hold (replays back to back)."""
    g = engine.runner.graphs
    for _ in range(3):
        g.replay(bucket)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay(bucket)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def graph_replay_ms(engine: Engine, batches: list[int]) -> dict[str, float]:
    """Device time of one captured decode forward on the all-zero capture inputs (every row the same token, so
    the MoE touches only top_k experts: a lower bound; `decode_tps` also times replays on real inputs)."""
    g = engine.runner.graphs
    return {f"graph replay ms B={b} (zero inputs)": replay_ms(engine, g.bucket_for(b)) for b in batches}


def profile_steps(engine: Engine, path: str) -> None:
    """Chrome trace (CPU + CUDA) of 5 engine steps of whatever is running; the split's window holds the last 4
    (`step_split.split_trace`): host gaps and device time per step."""
    sync(engine.config.device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            with torch.profiler.record_function(step_split.STEP_RANGE):
                engine.step()
        sync(engine.config.device)
    prof.export_chrome_trace(path)
    with open(path + ".txt", "w", encoding="utf-8") as f:
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def profile_eager_forward(engine: Engine, bucket: int, path: str) -> None:
    """Chrome trace of 2 eager forwards of a graph bucket on its static inputs (the last replayed step's), each in a
    `step_split.STEP_RANGE` range. It advances those requests' states again: run it only on requests about to end."""
    g = engine.runner.graphs
    g._forward(bucket)
    sync(engine.config.device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(2):
            with torch.profiler.record_function(step_split.STEP_RANGE):
                g._forward(bucket)
                sync(engine.config.device)
    prof.export_chrome_trace(path)


def profile_decode(engine: Engine, batch: int, path: str) -> None:
    """Kernel device times of eager decode forwards on the graph's static (scratch) inputs, top 25 by time."""
    g = engine.runner.graphs
    bucket = g.bucket_for(batch)
    g._forward(bucket)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g._forward(bucket)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"eager decode forward, bucket {bucket}, 3 calls\n{table}\n")
    print(table, flush=True)


def bench_variant(
    engine: Engine,
    args: argparse.Namespace,
    throughput: bool,
    ceilings: tuple[float, float] | None = None,
    notes: list[str] | None = None,
) -> dict[str, float]:
    """ceilings (bandwidth GB/s, bf16 TFLOP/s): also split each decode batch's step time (`decode_split`)."""
    out: dict[str, float] = {}
    if engine.runner.graphs is not None:
        out.update(graph_replay_ms(engine, args.decode_batches))
        if args.profile_out:
            profile_decode(engine, 1, args.profile_out)
    if throughput and args.throughput_first:
        out.update(run_throughput(engine, args, notes))
    for isl in args.isl:
        out[f"prefill ISL {isl}"] = prefill_tps(engine, isl, max(2, args.max_batched_tokens // isl * 2), seed=isl)
        print(f"  prefill ISL {isl}: {out[f'prefill ISL {isl}']:.0f} tok/s", flush=True)
    for b in args.decode_batches:
        out[f"decode B={b}"], phases = decode_tps(
            engine, b, args.prompt_len, args.decode_steps, 1000 + b, args.trace_dir, ceilings, notes
        )
        out.update(phases)
        print(f"  decode B={b}: {out[f'decode B={b}']:.1f} tok/s", flush=True)
    if throughput and not args.throughput_first:
        out.update(run_throughput(engine, args, notes))
    return out


def run_throughput(engine: Engine, args: argparse.Namespace, notes: list[str] | None) -> dict[str, float]:
    """The throughput run of the arguments, after an untimed warm-up that compiles the kernels of mixed
    prefill+decode steps at the run's sizes; prints its numbers. The warm-up sends 3 x (prompts per token budget)
    requests of 16 output tokens, twice a budget's worth at once: its steps fill the whole budget and cut a prompt
    into chunks beside decode rows, as the closed loop's do (a warm-up of 8 prompts at concurrency 4 never ran
    steps of more than 4 prompts or prompt chunks: the likely reason why the first engine run on a fresh machine
    lost ~100-140 ms per mixed step, benchmarks/RESULTS.md)."""
    per_step = max(1, args.max_batched_tokens // args.tp_isl)
    throughput_run(engine, 3 * per_step, args.tp_isl, 16, min(2 * per_step, args.tp_concurrency), seed=6)
    out = throughput_run(
        engine,
        args.tp_prompts,
        args.tp_isl,
        args.tp_osl,
        args.tp_concurrency,
        seed=7,
        trace_at=tuple(args.tp_trace_at),
        notes=notes,
    )
    print("  " + ", ".join(f"{k}: {v:.1f}" for k, v in out.items()), flush=True)
    return out


def variant_kernels(backend: str, options: list[str]) -> Kernels:
    """The backend's bundle; option `tiledmoe` sends every batch size to the sorted-token grouped GEMMs with the
    shared expert as separate linears (the bundle uses grouped GEMVs, shared expert included, for <= 16 pairs);
    `normfuse` fuses a Mamba layer's norms into in_proj / out_proj at batch 1 (off in the default bundle)."""
    kernels = get_kernels(backend)
    if "normfuse" in options:
        from service.engine.kernels.triton_backend import triton_kernels

        kernels = triton_kernels(fuse_norm_linear=True)
    if "tiledmoe" in options:
        from service.engine.kernels import triton_moe_gemv

        kernels = dataclasses.replace(kernels, moe_experts=triton_moe_gemv.moe_experts_tiled_shared)
    return kernels


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="nano", help="'nano', 'super' or the path of an HF config.json")
    ap.add_argument(
        "--formats",
        default="bf16",
        help="comma list of bf16 | fp8 (ModelOpt FP8 with the published "
        "recipe's exclusions): each builds its own dummy-weight model and runs every variant",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--variants",
        default="triton,triton+graphs",
        help="comma list of torch | triton | triton+graphs (CUDA graphs for decode-only steps, and for "
        "the plain decode rows of mixed steps) | triton+graphs+nosplit (mixed steps all eager); "
        "+tiledmoe: routed experts always as grouped GEMMs; +normfuse: a Mamba layer's norms "
        "fused into in_proj/out_proj at batch 1 (off by default); +sync: async scheduling off (each step's "
        "tokens are read before the next step is launched); +ssmbf16: bf16 SSM state pools for this variant "
        "(whatever --mamba-ssm-cache-dtype says)",
    )
    ap.add_argument("--throughput-variants", default="triton+graphs", help="variants that run the throughput test")
    ap.add_argument("--isl", default="1024,8192")
    ap.add_argument("--decode-batches", default="1,64,256")
    ap.add_argument("--tp-prompts", type=int, default=512, help="throughput run: number of random prompts")
    ap.add_argument("--tp-concurrency", type=int, default=256)
    ap.add_argument("--tp-isl", type=int, default=1024)
    ap.add_argument("--tp-osl", type=int, default=1024)
    ap.add_argument(
        "--throughput-first",
        action="store_true",
        help="run the throughput test before the prefill and decode measurements (its numbers print first)",
    )
    ap.add_argument(
        "--tp-trace-at",
        default="",
        help="comma list of step indices of the throughput run at which 4 steps are profiled (at least 4 apart): "
        "device busy, host gaps and device ms per kernel family of those steps",
    )
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens of each decode request")
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.90,
        help="the engine's memory plan sizes KV pages and Mamba slots from this fraction of the GPU",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16", "fp8"],
        help="the engines' KV cache: fp8 = float8_e4m3fn pages (unit scales with dummy weights), auto = the model dtype",
    )
    ap.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the engine's mamba_ssm_cache_dtype (auto: the checkpoint's, float32 for Nano and Super)",
    )
    ap.add_argument("--out", default="")
    ap.add_argument("--trace-dir", default="", help="write CPU+CUDA chrome traces of 4 decode steps per batch here")
    ap.add_argument("--profile-out", default="", help="write a kernel profile of a batch-1 decode forward here")
    ap.add_argument(
        "--step-split",
        action="store_true",
        help="profile 4 steps of every decode batch: device ms per kernel family (GEMM, MoE, attention, SSU, conv, "
        "norms, copies, other) and host gaps per step, next to the step's bound (weights + tensor-core work + "
        "state and KV traffic at roofline.py's measured bandwidth and bf16 peak); CUDA only",
    )

    args = ap.parse_args()
    args.isl = [int(x) for x in args.isl.split(",") if x]
    args.decode_batches = [int(x) for x in args.decode_batches.split(",") if x]
    args.tp_trace_at = [int(x) for x in args.tp_trace_at.split(",") if x]
    return args


def main() -> None:
    args = parse_args()
    variants = [v for v in args.variants.split(",") if v]
    tp_variants = set(args.throughput_variants.split(","))
    results: dict[str, dict[str, float]] = {}
    active: dict[str, float] = {}
    notes: list[str] = []  # the step splits' text lines, printed again with the table
    ceilings = None
    if args.step_split and args.device.startswith("cuda"):
        bw = max(roofline.copy_gbs(args.device), roofline.read_gbs(args.device))
        ceilings = (bw, roofline.matmul_tflops(args.device))
    # a decode request's prompt and output (`decode_tps`: prefill steps + timed steps + 16 tokens)
    decode_len = (
        args.prompt_len
        + args.decode_steps
        + 16
        + -(-max(args.decode_batches, default=1) * args.prompt_len // args.max_batched_tokens)
    )
    for fmt in [f for f in args.formats.split(",") if f]:
        model_dir = write_model_dir(args.config, fmt)
        base = dict(
            model_path=model_dir,
            device=args.device,
            dtype=args.dtype,
            page_size=args.page_size,
            mamba_cache_strategy="off",
            max_num_seqs=max(args.decode_batches + [args.tp_concurrency]),
            max_num_batched_tokens=args.max_batched_tokens,
            load_format="dummy",
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype,
            mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
            max_model_len=max(args.isl + [decode_len, args.tp_isl + args.tp_osl]) + 64,
        )
        model_cfg = ModelConfig.from_model_path(model_dir)
        t0 = time.perf_counter()
        model = build_model(
            EngineConfig(**base, kernel_backend=variants[0].split("+")[0]),
            model_cfg,
            getattr(torch, args.dtype),
            torch.device(args.device),
        )
        sync(args.device)
        print(f"{fmt} model: dummy weights drawn in {time.perf_counter() - t0:.1f} s", flush=True)
        active[fmt] = active_bytes_per_token(model, model_cfg)
        for variant in variants:
            backend, _, extra = variant.partition("+")
            model.kernels = variant_kernels(backend, extra.split("+"))
            t0 = time.perf_counter()
            options = extra.split("+")
            ssm = {"mamba_ssm_cache_dtype": "bfloat16"} if "ssmbf16" in options else {}
            engine = Engine(
                EngineConfig(
                    **{**base, **ssm},
                    kernel_backend=backend,
                    cuda_graphs=extra.startswith("graphs"),
                    async_scheduling="sync" not in extra.split("+"),
                ),
                model=model,
            )
            engine.runner.split_steps = engine.runner.graphs is not None and "nosplit" not in extra
            if engine.runner.memory_plan is not None:
                print(f"{fmt} {variant}: {engine.runner.memory_plan.log_line()}", flush=True)
            g = engine.runner.graphs
            graphs = f"{g.buckets}, keeping {g.captured_bytes / 2**30:.2f} GiB" if g is not None else None
            print(f"{fmt} {variant}: engine ready in {time.perf_counter() - t0:.1f} s (graphs: {graphs})", flush=True)
            notes.append(f"{fmt} {variant}:")
            results[f"{fmt} {variant}"] = bench_variant(engine, args, variant in tp_variants, ceilings, notes)
            del engine
            gc.collect()  # the engine's reference cycles hold its pools and graphs until collected
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        shutil.rmtree(model_dir, ignore_errors=True)
    report(results, active, args, notes if ceilings is not None or args.tp_trace_at else [])


def _fmt(v: float) -> str:
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.3f}"


def bandwidth_limit_lines(results: dict[str, dict[str, float]], active: dict[str, float], device: str) -> list[str]:
    """The batch-1 decode limit of each format: active weight bytes per step / the measured HBM bandwidth, the higher
    of the 1 GiB copy (read + write) and the 1 GiB read-only stream (`roofline`, the same ceilings as
    benchmarks/kernels.py); and each variant's fraction of it."""
    if not device.startswith("cuda"):
        return ["decode weight-bandwidth limit: needs a CUDA device"]
    copy, read = roofline.copy_gbs(device), roofline.read_gbs(device)
    bw = max(copy, read)
    lines = []
    for fmt, nbytes in active.items():
        limit = bw * 1e9 / nbytes
        lines.append(
            f"{fmt}: decode weight-bandwidth limit at batch 1: {nbytes / 1e9:.2f} GB active weights per step "
            f"/ {bw:.0f} GB/s measured (1 GiB copy {copy:.0f}, 1 GiB read {read:.0f}) = {limit:.0f} tok/s"
        )
        for b, r in results.items():
            if b.startswith(fmt + " ") and "decode B=1" in r:
                lines.append(f"  {b}: decode B=1 reaches {100 * r['decode B=1'] / limit:.1f}% of it")
    return lines


def report(
    results: dict[str, dict[str, float]], active: dict[str, float], args: argparse.Namespace, notes: list[str]
) -> None:
    backends = list(results)
    keys = list(dict.fromkeys(k for b in backends for k in results[b]))
    lines = ["| metric (tok/s unless named) | " + " | ".join(backends) + " |", "| --- |" + " ---: |" * len(backends)]
    lines += [
        f"| {k} | " + " | ".join(_fmt(results[b][k]) if k in results[b] else "-" for b in backends) + " |" for k in keys
    ]
    lines += [""] + bandwidth_limit_lines(results, active, args.device)
    if notes:
        lines += ["", "Decode step split (device ms per step) and bound:"] + notes
    meta = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "config": args.config,
        "prompt_len(decode)": args.prompt_len,
        "decode_steps": args.decode_steps,
        "max_num_batched_tokens": args.max_batched_tokens,
        "page_size": args.page_size,
        "mamba_ssm_cache_dtype": args.mamba_ssm_cache_dtype,
        "throughput": f"{args.tp_prompts} prompts, {args.tp_isl} in / {args.tp_osl} out, "
        f"concurrency {args.tp_concurrency}, ignore_eos",
    }
    text = json.dumps(meta) + "\n\n" + "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
