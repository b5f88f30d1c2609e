"""Fast pure-torch routed experts for the `torch` bundle (tuned on CPU). Same contract as `moe.moe_experts_ref`
(the oracle the tests compare against).

The expert weights are read as the grouped operands of the tokens-as-rows GEMMs: up as [E, d, I] and down as
[E, I, d], each a view of the weights `moe_weight_layout` lays out at load (up stored [d, E, I], down [E, I, d],
row-major; weights in the loaded layout cost a copy per call). Three ways, by the number of tokens and pairs
(measured on the 2-core dev machine, benchmarks/RESULTS.md):
- few tokens that reach every expert in fp32 (decode batches; pairs >= experts, at most `DENSE_MAX_TOKENS`): every
  expert runs on every token, dense: up as one GEMM over the stacked experts ([T, d] @ [d, E * I], a view), the
  routing weight (0 for an expert not picked) on the activation, down as one GEMM over the experts' stacked down
  rows ([T, E * I] @ [E * I, d], a view: the sum over the experts is the GEMM's own). 4x the routed FLOPs at 16
  experts top-4, but every expert's weights are read anyway, and no sort or per-expert GEMM loop (`F.grouped_mm`
  loops over the experts on the CPU).
- at most `LOOP_MAX_PAIRS` pairs (batch 1-2 decode): each pair as two GEMMs on its expert's matrices.
- otherwise (prefill, larger batches): the (token, slot) pairs are sorted by expert once and every expert runs
  inside two `F.grouped_mm` calls (up, then down) over the gathered token rows, `ROWS_BLOCK_TOKENS` tokens at a time,
  with no Python loop over experts.
As in the reference, each expert output is weighted in fp32, the shared expert (when given) and the routed sum
accumulate in fp32, and the result is rounded once to x's dtype.
`F.grouped_mm` needs row strides that are multiples of 16 bytes and, on CUDA, bf16: on any device other than the
CPU, or when d_in or I rows are not 16-byte multiples, this op is the reference itself (`moe_experts_ref`), said
here and in the bundle's docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.moe import check_shared_expert, moe_experts_ref

LOOP_MAX_PAIRS = 8  # (token, slot) pairs up to which each pair runs as its own two GEMMs (batch 1-2 decode)
DENSE_MAX_TOKENS = 32  # tokens up to which an fp32 batch whose pairs cover the experts runs every expert densely
ROWS_BLOCK_TOKENS = 2048  # tokens per block of the rows layout: its gathered rows and outputs stay cache-sized
GROUPED_MM_ALIGN = 16  # bytes: F.grouped_mm needs every operand's row stride a multiple of this


def moe_weight_layout(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.moe_weight_layout_ref` for this op: fp32 on the CPU, up [E, I, d_in] returned as a view of its values
    stored [d_in, E, I] and down [E, d_in, I] as a view of its values stored [E, I, d_in] (row-major: what every path
    of `moe_experts` reads without a copy); other dtypes (not measured) and devices (where this op is the
    reference) as loaded."""
    if down.device.type != "cpu" or down.dtype != torch.float32:
        return up, down
    return up.permute(2, 0, 1).contiguous().permute(1, 2, 0), down.transpose(1, 2).contiguous().transpose(1, 2)


def moe_experts(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, d_in], up [E, I, d_in], down [E, d_in, I], topk_weights [T, k] fp32, topk_ids [T, k] -> [T, d_in] in
    x's dtype: sum_k w * down(relu(up(x))^2), plus the shared expert when shared_up [S, d_in] and shared_down
    [d_in, S] are given."""
    d, I = x.shape[1], up.shape[1]
    if (
        x.device.type != "cpu"
        or (d * x.element_size()) % GROUPED_MM_ALIGN
        or (I * up.element_size()) % GROUPED_MM_ALIGN
    ):
        return moe_experts_ref(x, up, down, topk_weights, topk_ids, shared_up=shared_up, shared_down=shared_down)
    n_shared = check_shared_expert(x, shared_up, shared_down)
    T = x.shape[0]
    if n_shared:
        out = F.linear(_relu2_(F.linear(x, shared_up)), shared_down).float()
    else:
        out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    if topk_ids.numel() <= LOOP_MAX_PAIRS:
        _add_routed_pairs(out, x, up, down, topk_weights, topk_ids)
        return out.to(x.dtype)
    up_rows, down_rows = _operand(up.transpose(1, 2)), _operand(down.transpose(1, 2))  # [E, d, I], [E, I, d]
    if x.dtype == torch.float32 and up.shape[0] <= topk_ids.numel() and T <= DENSE_MAX_TOKENS:
        _add_routed_dense(out, x, up_rows, down_rows, topk_weights, topk_ids)
    else:
        for t0 in range(0, T, ROWS_BLOCK_TOKENS):
            t1 = min(T, t0 + ROWS_BLOCK_TOKENS)
            _add_routed_rows(out[t0:t1], x[t0:t1], up_rows, down_rows, topk_weights[t0:t1], topk_ids[t0:t1])
    return out.to(x.dtype)


def _operand(w: torch.Tensor) -> torch.Tensor:
    """Stacked expert matrices [E, r, c] as a grouped GEMM operand: w itself when its rows are contiguous and
    16-byte aligned (the `moe_weight_layout` views), else a row-major copy."""
    if w.stride(2) == 1 and (w.stride(1) * w.element_size()) % GROUPED_MM_ALIGN == 0:
        return w
    return w.contiguous()


def _relu2_(h: torch.Tensor) -> torch.Tensor:
    """`moe.relu2` in place on a fresh activation."""
    return h.relu_().square_()


def _sorted_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (order [n]: pair index t * k + j of each expert-sorted position, tok [n]: its token,
    offs [E] int32: end of each expert's run)."""
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0, dtype=torch.int32)
    return order, order // topk_ids.shape[1], offs


def _weighted(topk_weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The pairs' routing weights [n, 1] fp32 in sorted order."""
    return topk_weights.flatten()[order].float()[:, None]


def _add_routed_rows(
    out: torch.Tensor,
    x: torch.Tensor,
    up_rows: torch.Tensor,
    down_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """out [T, d] fp32 += the routed experts of x [T, d], tokens as rows (up_rows [E, d, I], down_rows [E, I, d]).
    fp32: the routing weight scales the activation before the down GEMM (linear, so equal up to rounding; the
    weighted copy is [n, I], not [n, d]); other dtypes weight the fp32 output as the reference does."""
    order, tok, offs = _sorted_pairs(topk_ids, up_rows.shape[0])
    w = _weighted(topk_weights, order)
    h = _relu2_(F.grouped_mm(x.index_select(0, tok), up_rows, offs=offs))  # [n, I]
    if x.dtype == torch.float32:
        out.index_add_(0, tok, F.grouped_mm(h.mul_(w), down_rows, offs=offs))
    else:
        out.index_add_(0, tok, F.grouped_mm(h, down_rows, offs=offs).float().mul_(w))


def _add_routed_pairs(
    out: torch.Tensor,
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """out [T, d] fp32 += the routed experts of x [T, d] (up [E, I, d], down [E, d, I], any layout), each (token,
    slot) pair as two `F.linear`s on its expert's matrices (views, no copy): at a few pairs this is fewer ops than
    `F.grouped_mm`, which runs a GEMM for every expert, picked or not. Weighted as `_add_routed_rows` does."""
    k = topk_ids.shape[1]
    for p, (e, w) in enumerate(zip(topk_ids.flatten().tolist(), topk_weights.float().flatten().tolist())):
        t = p // k
        h = _relu2_(F.linear(x[t : t + 1], up[e]))  # [1, I]
        if x.dtype == torch.float32:
            out[t : t + 1].add_(F.linear(h.mul_(w), down[e]))
        else:
            out[t : t + 1].add_(F.linear(h, down[e]).float(), alpha=w)


def _add_routed_dense(
    out: torch.Tensor,
    x: torch.Tensor,
    up_rows: torch.Tensor,
    down_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """out [T, d] fp32 += the routed experts of x [T, d] fp32 (up_rows [E, d, I], down_rows [E, I, d]), every
    expert on every token (weight 0 where not picked; a token's picks of one expert add up, as expert parallelism's
    weight-0 picks of local expert 0 do): one GEMM up, one GEMM down over the stacked experts."""
    T, (E, d, I) = x.shape[0], up_rows.shape
    dense_w = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, topk_ids, topk_weights.float())
    h = torch.mm(x, up_rows.transpose(0, 1).reshape(d, E * I))  # [T, d] @ [d, E * I] (a view when laid out)
    h = _relu2_(h).view(T, E, I).mul_(dense_w[:, :, None])
    out.addmm_(h.view(T, E * I), down_rows.reshape(E * I, d))  # [T, E * I] @ [E * I, d]: sum over the experts
