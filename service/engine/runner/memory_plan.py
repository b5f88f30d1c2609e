"""GPU memory planning: how many KV pages and Mamba live / snapshot slots fit after the weights and activations.

The arithmetic (`plan_memory`) is pure and unit-tested: budget = total * gpu_memory_utilization; what is left after
the weights, the activation peak of a profiling forward at the token budget and the CUDA-graph reserve (sized from
the captured buckets, `graph_reserve_bytes`) goes, in order, to max_num_seqs live Mamba slots (each running request
holds one), to the prefix cache's snapshot slots (at most the max_snapshots asked for, and at most SNAPSHOT_SHARE of
what the live slots leave), and to KV pages (the rest, up to `useful_pages`: twice what max_num_seqs requests of
max_model_len tokens hold, the second half for cached prefixes; memory beyond that stays free, so small engines
sharing a GPU, as the tests do, stay small). Too little memory for one request of max_model_len tokens -> ValueError
with the numbers; so is a plan whose pools do not fit in the memory the device has free (`check_free`: other processes
hold part of the budget).
`profile_activation_bytes` measures the activation peak on CUDA with one forward of max_num_batched_tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from service.engine.runner.cuda_graph import graph_buckets, graph_memory_bytes, layer_segments

GiB = 1 << 30
SNAPSHOT_SHARE = 0.25  # at most this share of the memory after live slots goes to snapshot slots


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one unit of each pool (this rank's shapes)."""

    kv_page: int  # one KV page over all attention layers: L_attn * 2 * page_size * Hkv * Dh * elem
    mamba_slot: int  # one Mamba slot over all Mamba layers: L_mamba * (conv_dim * (K-1) * elem + H*P*N * ssm_elem)


def state_bytes(
    num_attn_layers: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    kv_elem: int,
    num_mamba_layers: int,
    conv_dim: int,
    conv_kernel: int,
    conv_elem: int,
    mamba_heads: int,
    mamba_head_dim: int,
    state_size: int,
    ssm_elem: int = 4,
) -> StateBytes:
    """ssm_elem: bytes of one SSM state element (4 for fp32 states, 2 for bf16)."""
    kv = num_attn_layers * 2 * page_size * kv_heads * head_dim * kv_elem
    ssm = mamba_heads * mamba_head_dim * state_size * ssm_elem
    slot = num_mamba_layers * (conv_dim * (conv_kernel - 1) * conv_elem + ssm)
    return StateBytes(kv, slot)


@dataclass(frozen=True)
class MemoryPlan:
    """Where the GPU's memory goes (bytes) and the pool sizes that follow."""

    total_bytes: int  # the device's memory
    budget_bytes: int  # total * gpu_memory_utilization
    weights_bytes: int  # model parameters
    activation_bytes: int  # peak of the profiling forward above what was allocated before it
    graph_bytes: int  # reserve for CUDA graphs (0 without them)
    num_kv_pages: int  # usable pages (the pool adds the reserved page 0)
    num_live_slots: int  # Mamba live slots (= max_num_seqs)
    num_snapshot_slots: int  # Mamba snapshot slots of the prefix cache
    kv_bytes: int  # num_kv_pages * bytes per page
    mamba_live_bytes: int
    mamba_snapshot_bytes: int
    free_bytes: int  # budget left unplanned (< one page)

    def log_line(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (
            f"memory plan: budget {g(self.budget_bytes)} of {g(self.total_bytes)}: weights {g(self.weights_bytes)}"
            f", activations {g(self.activation_bytes)}, KV {g(self.kv_bytes)} ({self.num_kv_pages} pages), "
            f"Mamba live {g(self.mamba_live_bytes)} ({self.num_live_slots} slots), snapshots "
            f"{g(self.mamba_snapshot_bytes)} ({self.num_snapshot_slots} slots), CUDA graphs "
            f"{g(self.graph_bytes)}, free {g(self.free_bytes)}"
        )

    def stats(self) -> dict[str, float]:
        """The plan as engine stats (`memory_plan_*` keys, bytes and counts)."""
        return {f"memory_plan_{k}": float(v) for k, v in asdict(self).items()}


def plan_memory(
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_bytes: int,
    graph_bytes: int,
    sizes: StateBytes,
    max_num_seqs: int,
    max_model_len: int,
    page_size: int,
    max_snapshots: int,
    max_pages: int,
) -> MemoryPlan:
    """The plan (see the module docstring). max_snapshots: snapshot slots wanted at most (0: no prefix cache);
    max_pages: KV pages that can be of use at most (`useful_pages`)."""
    budget = int(total_bytes * utilization)
    left = budget - weights_bytes - activation_bytes - graph_bytes
    live = max_num_seqs
    live_bytes = live * sizes.mamba_slot
    min_pages = math.ceil(max_model_len / page_size)
    need = live_bytes + min_pages * sizes.kv_page
    if left < need:
        raise ValueError(
            f"the model does not fit: budget {budget / GiB:.2f} GiB (gpu_memory_utilization {utilization} of "
            f"{total_bytes / GiB:.2f} GiB) - weights {weights_bytes / GiB:.2f} GiB - activations "
            f"{activation_bytes / GiB:.2f} GiB - CUDA graphs {graph_bytes / GiB:.2f} GiB = {left / GiB:.2f} GiB, but "
            f"{max_num_seqs} Mamba live slots and one request of max_model_len {max_model_len} need {need / GiB:.2f} "
            "GiB: raise gpu_memory_utilization, or lower max_num_seqs, max_model_len or max_num_batched_tokens"
        )
    after_live = left - live_bytes
    snaps = min(max_snapshots, int(after_live * SNAPSHOT_SHARE) // max(sizes.mamba_slot, 1))
    if sizes.mamba_slot == 0:
        snaps = max_snapshots
    snap_bytes = snaps * sizes.mamba_slot
    pages = (after_live - snap_bytes) // sizes.kv_page if sizes.kv_page else min_pages
    pages = min(pages, max(min_pages, max_pages))
    kv_bytes = pages * sizes.kv_page
    return MemoryPlan(
        total_bytes,
        budget,
        weights_bytes,
        activation_bytes,
        graph_bytes,
        pages,
        live,
        snaps,
        kv_bytes,
        live_bytes,
        snap_bytes,
        after_live - snap_bytes - kv_bytes,
    )


def useful_pages(max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """KV pages an engine can use: every running request at max_model_len, twice over (cached prefixes)."""
    return 2 * max_num_seqs * math.ceil(max_model_len / page_size)


def weights_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def profile_activation_bytes(model, model_cfg, cfg, max_model_len: int, new_pools) -> int:
    """Peak bytes one forward of a prefill at the token budget (min(max_num_batched_tokens, max_model_len) tokens,
    logits for min(max_num_seqs, tokens) rows) allocates on CUDA above what was allocated before it. new_pools(sizes)
    builds the probe's pools (pages for those tokens, one live slot), freed afterwards."""
    from service.engine.cache.pools import PoolSizes
    from service.engine.distributed.step import StepPlan, StepRow
    from service.engine.request import SamplingParams
    from service.engine.runner.batch import build_forward_batch

    tokens = min(cfg.max_num_batched_tokens, max_model_len)
    num_pages = math.ceil(tokens / cfg.page_size)
    pools = new_pools(PoolSizes(num_pages + 1, 1, 0))
    sched = StepPlan(
        (
            StepRow(
                "memory-profile",
                0,
                tokens,
                1,
                tuple(range(1, num_pages + 1)),
                (1,) * tokens,
                (),
                SamplingParams(max_tokens=1),
            ),
        ),
        slot_zeros=(1,),
    )
    device = pools.kv.device
    batch = build_forward_batch(sched, cfg.page_size, model_cfg.chunk_size, device)
    rows = torch.arange(min(cfg.max_num_seqs, tokens), device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(batch.input_ids, batch.attn, batch.mamba, rows, pools.kv, pools.conv, pools.ssm)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pools, batch
    torch.cuda.empty_cache()
    return peak


def graph_reserve_bytes(cfg, model_cfg) -> int:
    """What the decode CUDA graphs will keep (`cuda_graph.graph_memory_bytes` of the buckets up to max_num_seqs);
    0 when no graphs are captured (cuda_graphs off, or the torch kernels)."""
    if not (cfg.cuda_graphs and cfg.kernel_backend == "triton"):
        return 0
    segments = len(layer_segments(model_cfg.num_layers))
    return graph_memory_bytes(graph_buckets(cfg.max_num_seqs), model_cfg.vocab_size, model_cfg.hidden_size, segments)


def plan_for(
    cfg,
    model_cfg,
    model,
    max_model_len: int,
    dtype: torch.dtype,
    new_pools,
    kv_dtype: torch.dtype | None = None,
    ssm_dtype: torch.dtype = torch.float32,
) -> MemoryPlan:
    """The plan of this engine on its CUDA device: weights counted, activations profiled, pools sized (KV pages
    in kv_dtype, default dtype; conv state in dtype; SSM states in ssm_dtype)."""
    m, s = model_cfg, model.shapes  # this rank's heads and groups
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = state_bytes(
        len(m.attention_layer_ids),
        cfg.page_size,
        s.kv_heads,
        m.head_dim,
        torch.tensor([], dtype=kv_dtype or dtype).element_size(),
        len(m.mamba_layer_ids),
        s.conv_dim,
        m.conv_kernel,
        elem,
        s.mamba_heads,
        m.mamba_head_dim,
        m.ssm_state_size,
        torch.tensor([], dtype=ssm_dtype).element_size(),
    )
    activations = profile_activation_bytes(model, model_cfg, cfg, max_model_len, new_pools)
    total = torch.cuda.mem_get_info(torch.device(cfg.device))[1]
    snapshots = (
        0
        if cfg.mamba_cache_strategy == "off"
        else (cfg.max_mamba_snapshots if cfg.max_mamba_snapshots is not None else 2 * cfg.max_num_seqs)
    )
    plan = plan_memory(
        total,
        cfg.gpu_memory_utilization,
        weights_bytes(model),
        activations,
        graph_reserve_bytes(cfg, model_cfg),
        sizes,
        cfg.num_mamba_slots or cfg.max_num_seqs,
        max_model_len,
        cfg.page_size,
        snapshots,
        useful_pages(cfg.max_num_seqs, max_model_len, cfg.page_size),
    )
    device = torch.device(cfg.device)
    free = torch.cuda.mem_get_info(device)[0]
    check_free(plan, free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return plan


def check_free(plan: MemoryPlan, available_bytes: int) -> None:
    """ValueError with the numbers when what the plan still allocates (pools, graph reserve, activations) exceeds
    `available_bytes` (the device's free memory plus what this process's allocator holds unused): other processes
    hold memory the budget counted on."""
    need = plan.kv_bytes + plan.mamba_live_bytes + plan.mamba_snapshot_bytes + plan.graph_bytes + plan.activation_bytes
    if need > available_bytes:
        others = plan.total_bytes - available_bytes - plan.weights_bytes
        raise ValueError(
            f"the memory plan still allocates {need / GiB:.2f} GiB (KV, Mamba slots, CUDA graphs, activations) but "
            f"only {available_bytes / GiB:.2f} GiB of the {plan.total_bytes / GiB:.2f} GiB device are free: other "
            f"processes (and the CUDA context) hold about {max(others, 0) / GiB:.2f} GiB. Free the GPU, or lower "
            f"gpu_memory_utilization (now {plan.budget_bytes / plan.total_bytes:.2f}), max_num_seqs or max_model_len"
        )
