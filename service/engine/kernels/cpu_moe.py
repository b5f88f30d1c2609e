"""Fast pure-torch routed experts for the `torch` bundle (tuned on CPU). Same contract as `moe.moe_experts_ref`
(the oracle the tests compare against).

The (token, slot) pairs are sorted by expert once and every expert runs inside two `F.grouped_mm` calls (up, then
down), with no Python loop over experts. Two layouts, by the number of pairs (measured on the 2-core dev machine,
benchmarks/RESULTS.md):
- few pairs (decode): the expert weights are the grouped operand as stored ([E, I, d] and [E, d, I], row-major) and
  the tokens are gathered as columns ([d, pairs]): nothing but the small activations is copied.
- many pairs (prefill): the tokens are rows ([pairs, d]) and the weights are the grouped operand transposed to
  [E, d, I] / [E, I, d] once per call (a copy of the expert weights, small against the GEMMs it feeds; the CPU
  grouped GEMM is several times slower on a transposed view).
As in the reference, each expert output is weighted in fp32, the shared expert (when given) and the routed sum
accumulate in fp32, and the result is rounded once to x's dtype.
`F.grouped_mm` needs row strides that are multiples of 16 bytes and, on CUDA, bf16: on any device other than the
CPU, or when d_in or I rows are not 16-byte multiples, this op is the reference itself (`moe_experts_ref`), said
here and in the bundle's docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.engine.kernels.moe import check_shared_expert, moe_experts_ref, relu2

ROWS_LAYOUT_MIN_PAIRS = 1024  # (token, slot) pairs from which the tokens-as-rows layout is used
GROUPED_MM_ALIGN = 16  # bytes: F.grouped_mm needs every operand's row stride a multiple of this


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
    T, k = topk_ids.shape
    flat = topk_ids.flatten()
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=up.shape[0]), 0, dtype=torch.int32)
    tok = order // k
    if n >= ROWS_LAYOUT_MIN_PAIRS:
        h = relu2(F.grouped_mm(x.index_select(0, tok), up.transpose(1, 2).contiguous(), offs=offs))  # [n, I]
        routed = F.grouped_mm(h, down.transpose(1, 2).contiguous(), offs=offs)  # [n, d]
    else:  # pairs as columns, padded to an aligned row stride; columns past offs[-1] are not computed
        cols = -(-n * x.element_size() // GROUPED_MM_ALIGN) * GROUPED_MM_ALIGN // x.element_size()
        xs = x.t().index_select(1, F.pad(tok, (0, cols - n)))  # [d, cols]
        h = relu2(F.grouped_mm(up, xs, offs=offs))  # [I, cols]
        routed = F.grouped_mm(down, h, offs=offs)[:, :n].t()  # [n, d]
    if n_shared:
        out = F.linear(relu2(F.linear(x, shared_up)), shared_down).float()
    else:
        out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    w = topk_weights.flatten()[order].float()
    return out.index_add_(0, tok, routed.float() * w[:, None]).to(x.dtype)
