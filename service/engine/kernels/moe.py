"""NemotronH MoE routing and expert computation. Pure torch reference.

Routing: fp32 logits `h @ W.T`, `s = sigmoid`, pick top-k of `s + bias` (group-limited when
n_group > 1: keep the topk_group groups with the largest sum of their top-2), weights = s at the
picked experts, renormalised if norm_topk_prob, times routed_scaling_factor.
Experts: non-gated ReLU² MLPs `down(relu(up(x))**2)`; the shared expert (when passed to `moe_experts_ref`) is one
more such MLP with weight 1, added in fp32 before the one rounding to x's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def moe_route_ref(
    h: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, d], gate_weight [E, d] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    logits = F.linear(h.float(), gate_weight.float())
    scores = logits.sigmoid()
    choice = scores + correction_bias.float()
    E = choice.shape[1]
    if n_group > 1:
        grouped = choice.view(-1, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_weight_layout_ref(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert weights in the loaded layout, row-major up [E, I, d_in] and down [E, d_in, I] (the same tensors
    when they are; a bundle whose `moe_experts` reads another memory layout faster returns the same values in that
    layout)."""
    return up.contiguous(), down.contiguous()


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


def check_shared_expert(x: torch.Tensor, shared_up: torch.Tensor | None, shared_down: torch.Tensor | None) -> int:
    """Shape checks of the optional shared expert of the routed-experts ops: both or neither of shared_up [S, d_in]
    and shared_down [d_in, S] (x [T, d_in]); returns S, 0 when neither is given."""
    if (shared_up is None) != (shared_down is None):
        raise ValueError(
            "pass both shared_up [S, d_in] and shared_down [d_in, S] (the shared expert's up_proj and "
            "down_proj weights) or neither, got only " + ("shared_up" if shared_up is not None else "shared_down")
        )
    if shared_up is None or shared_down is None:
        return 0
    d_in = x.shape[-1]
    S = shared_up.shape[0]
    if shared_up.dim() != 2 or shared_up.shape[1] != d_in or tuple(shared_down.shape) != (d_in, S):
        raise ValueError(
            f"shared_up must be [S, d_in] and shared_down [d_in, S] with d_in={d_in}, got "
            f"{tuple(shared_up.shape)} and {tuple(shared_down.shape)}"
        )
    return S


def moe_experts_ref(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, d_in], up [E, I, d_in], down [E, d_in, I], topk [T, k] -> sum_k w * expert(x) [T, d_in], plus the shared
    expert shared_down(relu(shared_up(x))^2) when shared_up [S, d_in] and shared_down [d_in, S] are given (both or
    neither). Accumulates in fp32 like transformers (weights fp32), returns x's dtype."""
    n_shared = check_shared_expert(x, shared_up, shared_down)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=up.shape[0]).tolist()
    tok = order // topk_ids.shape[1]
    w = topk_weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = tok[start : start + n]
        hidden = F.linear(relu2(F.linear(x[t], up[e])), down[e])
        out.index_add_(0, t, hidden.float() * w[start : start + n, None])
        start += n
    if n_shared:
        out += F.linear(relu2(F.linear(x, shared_up)), shared_down).float()
    return out.to(x.dtype)


@dataclass(frozen=True)
class ExpertAlignment:
    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: pair index t*k + j, or T*k for padding
    block_expert: torch.Tensor  # [num_blocks] int32: expert of each block of block_m rows, -1 for unused blocks
    block_m: int  # rows per block


def max_expert_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on sum_e ceil(count_e / block_m) over the experts that got pairs: at most
    min(num_experts, num_pairs) experts are non-empty, each adds < 1 block of padding, so
    cdiv(num_pairs, block_m) + min(num_experts, num_pairs) blocks always suffice (decode T=1, top-6: 7 blocks,
    not 1 + 128: the grouped GEMMs launch no programs that only exit)."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Torch oracle of `align_by_expert` (about 20 device ops, no host sync)."""
    flat = topk_ids.flatten()
    tk = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends_p = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(tk, device=dev) - starts[sorted_e]
    num_blocks = max_expert_blocks(tk, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), tk, dtype=torch.int32, device=dev)
    sorted_pairs[ends_p[sorted_e] - padded[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(ends_p, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertAlignment(sorted_pairs, block_expert, block_m)
