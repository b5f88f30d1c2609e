"""Fast pure-torch routed experts for the `torch` bundle (tuned on CPU). Same contract as `moe.moe_experts_ref`
(the oracle the tests compare against).

The (token, slot) pairs are sorted by expert once and every expert runs inside two `F.grouped_mm` calls (up, then
down), with no Python loop over experts. The down weights are read as rows [E, I, d] (`moe_weight_layout` stores
them so at load: a view; weights in the loaded layout cost one copy per call). Three layouts, by the number of tokens
and pairs (measured on the 2-core dev machine, benchmarks/RESULTS.md):
- few pairs (decode): up as stored ([E, I, d], row-major) is the grouped operand and the tokens are gathered as
  columns ([d, pairs]); the activations come back as rows ([pairs, I], a small copy) for the down rows.
- few tokens that reach every expert in fp32 (decode batches; pairs >= experts, at most `DENSE_MAX_TOKENS`): every
  expert runs on every token, dense: up as one GEMM over the stacked weights ([T, d] @ [E * I, d]^T, a view), the
  routing weight (0 for an expert not picked) on the activation, down as one GEMM over the experts' stacked down
  rows ([T, E * I] @ [E * I, d], a view: the sum over the experts is the GEMM's own). 4x the routed FLOPs at 16
  experts top-4, but every expert's weights are read anyway, and no sort, bincount or per-expert GEMM loop
  (`F.grouped_mm` loops over the experts on the CPU).
- many pairs (prefill): the tokens are rows ([pairs, d]) and the up weights are the grouped operand transposed to
  [E, d, I] once per call (a copy of the up weights, small against the GEMMs it feeds; the CPU grouped GEMM is
  several times slower on a transposed view).
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

ROWS_LAYOUT_MIN_PAIRS = 1024  # (token, slot) pairs from which the tokens-as-rows layout is used
DENSE_MAX_TOKENS = 32  # tokens up to which an fp32 batch whose pairs cover the experts runs every expert densely
ROWS_BLOCK_TOKENS = 2048  # tokens per block of the rows layout: its gathered rows and outputs stay cache-sized
GROUPED_MM_ALIGN = 16  # bytes: F.grouped_mm needs every operand's row stride a multiple of this


def moe_weight_layout(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.moe_weight_layout_ref` for this op: on the CPU, down [E, d_in, I] returned as the transposed view of its
    values stored as rows [E, I, d_in] (what every path of `moe_experts` reads), up as loaded; off the CPU (where
    this op is the reference) both as loaded. Same shapes and values: every bundle's ops take either layout."""
    if down.device.type != "cpu":
        return up, down
    return up, down.transpose(1, 2).contiguous().transpose(1, 2)


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
    down_rows = down.transpose(1, 2).contiguous()  # [E, I, d]: a view in `moe_weight_layout`'s layout, else a copy
    if x.dtype == torch.float32 and up.shape[0] <= topk_ids.numel() and T <= DENSE_MAX_TOKENS:
        _add_routed_dense(out, x, up, down_rows, topk_weights, topk_ids)
    elif topk_ids.numel() < ROWS_LAYOUT_MIN_PAIRS:
        _add_routed_columns(out, x, up, down_rows, topk_weights, topk_ids)
    else:
        up_rows = up.transpose(1, 2).contiguous()
        for t0 in range(0, T, ROWS_BLOCK_TOKENS):
            t1 = min(T, t0 + ROWS_BLOCK_TOKENS)
            _add_routed_rows(out[t0:t1], x[t0:t1], up_rows, down_rows, topk_weights[t0:t1], topk_ids[t0:t1])
    return out.to(x.dtype)


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


def _add_routed_columns(
    out: torch.Tensor,
    x: torch.Tensor,
    up: torch.Tensor,
    down_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """out [T, d] fp32 += the routed experts (up [E, I, d], down_rows [E, I, d]): up with the pairs as columns padded
    to an aligned row stride (columns past the last pair are not computed), down with them as rows."""
    order, tok, offs = _sorted_pairs(topk_ids, up.shape[0])
    n = order.numel()
    cols = -(-n * x.element_size() // GROUPED_MM_ALIGN) * GROUPED_MM_ALIGN // x.element_size()
    xs = x.t().index_select(1, F.pad(tok, (0, cols - n)))  # [d, cols]
    h = _relu2_(F.grouped_mm(up, xs, offs=offs))  # [I, cols]
    routed = F.grouped_mm(h[:, :n].t().contiguous(), down_rows, offs=offs)  # [n, d]
    out.index_add_(0, tok, routed.float() * _weighted(topk_weights, order))


def _add_routed_dense(
    out: torch.Tensor,
    x: torch.Tensor,
    up: torch.Tensor,
    down_rows: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    """out [T, d] fp32 += the routed experts of x [T, d] fp32 (up [E, I, d], down_rows [E, I, d]), every expert on
    every token (weight 0 where not picked; a token's picks of one expert add up, as expert parallelism's weight-0
    picks of local expert 0 do): one GEMM up, one GEMM down over the stacked experts."""
    T, (E, I, d) = x.shape[0], up.shape
    dense_w = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, topk_ids, topk_weights.float())
    h = _relu2_(F.linear(x, up.reshape(E * I, d))).view(T, E, I).mul_(dense_w[:, :, None])
    out.addmm_(h.view(T, E * I), down_rows.view(E * I, d))  # [T, E * I] @ [E * I, d]: sum over the experts
