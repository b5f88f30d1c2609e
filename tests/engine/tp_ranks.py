"""Runs a function on tp ranks (spawned processes, gloo over 127.0.0.1) and the packed forwards the tensor-parallel
tests compare: every rank builds its shard and a tp-1 copy of the same weights, runs the same steps on both and
checks its shard against the tp-1 copy (logits and its slice of every state pool)."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.engine.config import ModelConfig
from service.engine.distributed.parallel import ParallelContext, RankShapes
from service.engine.distributed.step import StepPlan, StepRow
from service.engine.kernels import get_kernels
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.model.weights import load_weights
from service.engine.request import SamplingParams
from service.engine.runner.batch import ForwardBatch, build_forward_batch

PAGE_SIZE = 4
# A packed multi-step workload: per step, (request, first position, tokens). Mixed prompt lengths; request 1's
# prefill is chunked over two steps; step 1 mixes decodes, that chunk and a new prompt; step 2 decodes only.
PROMPT_LENS = (40, 34, 8, 14)  # tokens fed: 23, 31, 5, 12
STEPS = (
    ((0, 0, 21), (1, 0, 13), (2, 0, 3)),
    ((0, 21, 1), (1, 13, 17), (2, 3, 1), (3, 0, 11)),
    ((0, 22, 1), (1, 30, 1), (2, 4, 1), (3, 11, 1)),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, tp: int, *args) -> None:
    """fn(parallel, *args) on tp ranks; a rank's exception fails the call (the other ranks are ended)."""
    mp.spawn(_entry, args=(fn, tp, free_port(), args), nprocs=tp, join=True)


def _entry(rank: int, fn, tp: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp, timeout=timedelta(seconds=120)
    )
    try:
        fn(ParallelContext(tp=tp, ep=1, rank=rank, group=dist.group.WORLD), *args)
    finally:
        dist.destroy_process_group()


def with_ep(parallel: ParallelContext, ep: int) -> ParallelContext:
    return ParallelContext(tp=parallel.tp, ep=ep, rank=parallel.rank, group=parallel.group)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@dataclass(frozen=True)
class Pools:
    """One rank's state tensors (the engine's pool layout): KV pages, conv and SSM state slots (slot 0 unused)."""

    kv: torch.Tensor  # [L_attn, 2, pages * PAGE_SIZE, this rank's KV heads, Dh]
    conv: torch.Tensor  # [L_mamba, slots, this rank's conv channels, K-1]
    ssm: torch.Tensor  # [L_mamba, slots, this rank's Mamba heads, P, N] fp32


def make_pools(cfg: ModelConfig, shapes: RankShapes, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Pools:
    """Zeroed pools sized for this rank: its KV heads, conv channels and Mamba heads."""
    pages, slots = 1 + sum(-(-n // PAGE_SIZE) for n in PROMPT_LENS), 1 + len(PROMPT_LENS)
    la, lm = len(cfg.attention_layer_ids), len(cfg.mamba_layer_ids)
    return Pools(
        torch.zeros(la, 2, pages * PAGE_SIZE, shapes.kv_heads, cfg.head_dim, dtype=dtype, device=device),
        torch.zeros(lm, slots, shapes.conv_dim, cfg.conv_kernel - 1, dtype=dtype, device=device),
        torch.zeros(
            lm, slots, shapes.mamba_heads, cfg.mamba_head_dim, cfg.ssm_state_size, dtype=torch.float32, device=device
        ),
    )


def step_batches(cfg: ModelConfig, device: str = "cpu") -> list[ForwardBatch]:
    """The ForwardBatches of STEPS (built by the runner's batch builder from step plans; every token's logits are
    asked for). Request i owns live slot i + 1 and consecutive KV pages from page 1 on."""
    toks = prompts(cfg.vocab_size)
    pages, first_page = [], 1
    for t in toks:
        n = -(-len(t) // PAGE_SIZE)
        pages.append(tuple(range(first_page, first_page + n)))
        first_page += n
    out = []
    for step in STEPS:
        plan = StepPlan(
            tuple(
                StepRow(f"r{i}", p, n, i + 1, pages[i], tuple(toks[i][p : p + n]), (), SamplingParams(max_tokens=1))
                for i, p, n in step
            )
        )
        out.append(build_forward_batch(plan, PAGE_SIZE, cfg.chunk_size, torch.device(device)))
    return out


def run_steps(model: NemotronHForCausalLM, pools: Pools, batches: list[ForwardBatch]) -> list[torch.Tensor]:
    """The model's forward over every step: logits [T, vocab] fp32 of every token."""
    out = []
    for b in batches:
        idx = torch.arange(b.input_ids.shape[0], device=b.input_ids.device)
        out.append(model(b.input_ids, b.attn, b.mamba, idx, pools.kv, pools.conv, pools.ssm))
    return out


@torch.inference_mode()
def run_layerwise(model: NemotronHForCausalLM, pools: Pools, batches: list[ForwardBatch]) -> list[list[torch.Tensor]]:
    """The same steps one layer at a time (`run_layers(lid, lid + 1)`): per step, the residual stream h after the
    embedding and after each layer."""
    out = []
    for b in batches:
        x, h = model.embed(b.input_ids)
        hs = [h]
        for lid in range(len(model.backbone.layers)):
            x, h = model.run_layers(x, h, lid, lid + 1, b.attn, b.mamba, pools.kv, pools.conv, pools.ssm)
            hs.append(h)
        out.append(hs)
    return out


def pool_slices(cfg: ModelConfig, s: RankShapes, whole: Pools) -> dict[str, torch.Tensor]:
    """The tp-1 pools cut to what rank `s` holds: KV heads, conv channels (x, B, C of its heads and groups), heads."""
    P, N = cfg.mamba_head_dim, cfg.ssm_state_size
    di, gn = cfg.mamba_intermediate, cfg.n_groups * N
    x0, g0 = s.mamba_head_start * P, s.mamba_group_start * N
    chans = torch.cat(
        [
            torch.arange(x0, x0 + s.mamba_intermediate),
            di + torch.arange(g0, g0 + s.mamba_groups * N),
            di + gn + torch.arange(g0, g0 + s.mamba_groups * N),
        ]
    )
    return {
        "kv": whole.kv[:, :, :, s.kv_head_start : s.kv_head_start + s.kv_heads],
        "conv": whole.conv[:, :, chans.to(whole.conv.device)],
        "ssm": whole.ssm[:, :, s.mamba_head_start : s.mamba_head_start + s.mamba_heads],
    }


def build(
    cfg: ModelConfig, path: str, parallel: ParallelContext, kernel_backend: str, device: str, dtype: torch.dtype
) -> NemotronHForCausalLM:
    with torch.device(device):
        m = NemotronHForCausalLM(cfg, get_kernels(kernel_backend), parallel).to(dtype)
    load_weights(m, path, cfg.tie_word_embeddings, parallel)
    return m.eval()


CLEAR_MARGIN = 0.05  # a row whose top-2 logits differ by more than this has an unambiguous greedy token


def _margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def count_collectives(fn) -> dict[str, int]:
    """fn() with torch.distributed.all_reduce / all_gather counted (the layers call them through the module)."""
    calls = {"all_reduce": 0, "all_gather": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(dist, name, counted(name))
    try:
        fn()
    finally:
        for name, f in originals.items():
            setattr(dist, name, f)
    return calls


def expected_collectives(model: NemotronHForCausalLM, device: str) -> dict[str, int]:
    """One all-reduce per layer and for the embedding, one more per Mamba layer whose norm groups span ranks, one
    all-gather of the logits (an all-reduce on gloo with CUDA tensors)."""
    reduces = 1 + len(model.backbone.layers)
    if model.shapes.group_ranks > 1:
        reduces += len(model.cfg.mamba_layer_ids)
    gather_by_reduce = device.startswith("cuda") and dist.get_backend(model.parallel.group) == "gloo"
    return {"all_reduce": reduces + gather_by_reduce, "all_gather": int(not gather_by_reduce)}


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def compare(
    parallel: ParallelContext,
    path: str,
    eps: tuple[int, ...],
    kernel_backend: str = "torch",
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, float]:
    """This rank's shard of the checkpoint at `path` (for each ep) vs the tp-1 model over STEPS, as
    name -> max abs difference: `ep{e}/logits`, `ep{e}/logprobs`, `ep{e}/argmax` (rows whose greedy token differs;
    `argmax_clear`: those of them where tp 1's top-2 logits are more than CLEAR_MARGIN apart),
    `ep{e}/kv|conv|ssm` (its pools vs its slice of the tp-1 pools after the full forward), and
    `ep{e}/layer{i}{letter}` / `ep{e}/embed` (the residual stream after that layer, run one layer at a time),
    `ep{e}/collectives` (1 when one forward's all-reduce / all-gather counts differ from `expected_collectives`)."""
    cfg = ModelConfig.from_model_path(path)
    ref_model = build(cfg, path, ParallelContext(), kernel_backend, device, dtype)

    def passes(model: NemotronHForCausalLM):
        pools = [make_pools(cfg, model.shapes, dtype, device) for _ in range(2)]
        logits = run_steps(model, pools[0], step_batches(cfg, device))
        return logits, pools[0], run_layerwise(model, pools[1], step_batches(cfg, device))

    ref_logits, ref_pools, ref_layers = passes(ref_model)
    out: dict[str, float] = {}
    for ep in eps:
        model = build(cfg, path, with_ep(parallel, ep), kernel_backend, device, dtype)
        logits, pools, layers = passes(model)
        k = f"ep{ep}/"
        fresh = make_pools(cfg, model.shapes, dtype, device)
        batch = step_batches(cfg, device)[0]
        calls = count_collectives(lambda m=model, f=fresh, b=batch: run_steps(m, f, [b]))
        out[k + "collectives"] = float(calls != expected_collectives(model, device))
        out[k + "logits"] = max(_max_err(a, b) for a, b in zip(ref_logits, logits))
        out[k + "logprobs"] = max(_max_err(a.log_softmax(-1), b.log_softmax(-1)) for a, b in zip(ref_logits, logits))
        out[k + "argmax"] = float(sum((a.argmax(-1) != b.argmax(-1)).sum().item() for a, b in zip(ref_logits, logits)))
        out[k + "argmax_clear"] = float(
            sum(
                ((a.argmax(-1) != b.argmax(-1)) & (_margin(a) > CLEAR_MARGIN)).sum().item()
                for a, b in zip(ref_logits, logits)
            )
        )
        mine = {"kv": pools.kv, "conv": pools.conv, "ssm": pools.ssm}
        for name, want in pool_slices(cfg, model.shapes, ref_pools).items():
            out[k + name] = _max_err(mine[name], want)
        names = ["embed"] + [f"layer{i}{t}" for i, t in enumerate(cfg.layer_types)]
        for j, name in enumerate(names):
            out[k + name] = max(_max_err(a[j], b[j]) for a, b in zip(ref_layers, layers))
    return out


def report(
    world: ParallelContext,
    paths: dict[str, str],
    tps: tuple[int, ...],
    out_dir: str,
    kernel_backend: str = "torch",
    device: str = "cpu",
) -> None:
    """For each tp in tps, on world ranks [0, tp) (their own process group): `compare` with ep = 1 and ep = tp for
    every checkpoint (name -> path). Writes rank{r}.json: {tp: {checkpoint: {check: difference}}}."""
    result = {}
    for tp in tps:
        group = world.group if tp == world.tp else dist.new_group(list(range(tp)))  # every rank joins the call
        if world.rank < tp:
            par = ParallelContext(tp=tp, ep=1, rank=world.rank, group=group)
            result[tp] = {name: compare(par, path, (1, tp), kernel_backend, device) for name, path in paths.items()}
    with open(os.path.join(out_dir, f"rank{world.rank}.json"), "w") as f:
        json.dump(result, f)
