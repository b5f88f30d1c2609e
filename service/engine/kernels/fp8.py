"""FP8 (float8_e4m3fn, per-tensor scales) linears and MoE experts: the torch references and the Hopper GEMM.

The scheme is ModelOpt's static per-tensor FP8: W ~= weight * weight_scale (weight e4m3, weight_scale fp32), and
the activation is quantized with a fixed, calibrated scale: xq = e4m3(clamp(x / input_scale, +-448)), so
x ~= xq * input_scale. A linear is then (xq @ weight^T) * (input_scale * weight_scale).

- `fp8_linear_ref`: that math in fp32 on any device (both operands dequantized), the result in x's dtype; the
  oracle of `fp8_linear`.
- `fp8_linear`: `torch._scaled_mm` (FP8 tensor cores on Hopper, fp32 accumulation; torch also runs it on CPU). It
  needs K and N multiples of 16: other shapes are zero-padded per call (no NemotronH projection needs it).
- `fp8_linear_dequant_ref` (the torch bundle's op): the weight dequantized, the activation kept (weight-only math,
  W8A16): what the FP8 weights alone give, so an FP8 model on the torch bundle equals an unquantized model on the
  dequantized weights up to rounding.
- `fp8_moe_experts_ref`: routed experts with per-expert weight scales [E] (one expert dequantized at a time), plus
  an optional FP8 shared expert (`Fp8Linear` up and down), as `moe.moe_experts_ref` otherwise; weight-only unless
  quantize_activations (then x and the ReLU² output are fake-quantized with the GEMMs' input scales: the
  checkpoint's W8A8 math). The Triton kernels (`triton_moe`, `triton_moe_gemv`) compute either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from service.engine.kernels.moe import relu2

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


@dataclass(frozen=True)
class Fp8Linear:
    """One FP8 linear's tensors (ModelOpt per-tensor scheme), handed to the experts ops as the shared expert."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor  # fp32, one element: W ~= weight * weight_scale
    input_scale: torch.Tensor  # fp32, one element: x is quantized as x / input_scale (W8A8 GEMMs)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any shape) / scale (fp32 scalar) clamped to +-448 -> float8_e4m3fn, same shape."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The value the FP8 GEMM sees for x: quantize_fp8(x, scale) * scale, fp32."""
    return quantize_fp8(x, scale).float() * scale


def check_fp8_linear_args(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"fp8 linear: x must be [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 linear: weight must be {FP8_DTYPE}, got {weight.dtype}")
    if weight_scale.numel() != 1 or input_scale.numel() != 1:
        raise ValueError(
            f"fp8 linear: weight_scale and input_scale must be per-tensor scalars, got shapes "
            f"{tuple(weight_scale.shape)} and {tuple(input_scale.shape)}"
        )


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """x [T, K] (model dtype), weight [N, K] e4m3, weight_scale / input_scale fp32 scalars, bias [N] or None
    -> [T, N] in x's dtype, computed in fp32 on dequantized operands."""
    check_fp8_linear_args(x, weight, weight_scale, input_scale)
    xs = fake_quantize_fp8(x, input_scale) if quantize_activations else x.float()
    out = F.linear(xs, weight.float() * weight_scale.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_linear_dequant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-only: `fp8_linear_ref` without quantizing x (input_scale is checked, not used)."""
    return fp8_linear_ref(x, weight, weight_scale, input_scale, bias, quantize_activations=False)


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return F.pad(t.view(torch.uint8), pad).view(t.dtype)  # F.pad has no float8 kernels: pad the bytes


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fp8_linear_ref` on FP8 tensor cores (`torch._scaled_mm`): x [T, K] -> [T, N] in x's dtype."""
    check_fp8_linear_args(x, weight, weight_scale, input_scale)
    return scaled_mm(quantize_fp8(x, input_scale), weight, weight_scale, input_scale, bias, x.dtype)


def scaled_mm(
    xq: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq @ weight^T) * input_scale * weight_scale (+ bias) by `torch._scaled_mm`: xq [T, K] and weight [N, K]
    e4m3, the scales fp32 scalars -> [T, N] in out_dtype. K and N are zero-padded to multiples of 16 when needed."""
    N = weight.shape[0]
    xq = _pad_to(xq, 1, 16)
    w = _pad_to(_pad_to(weight, 1, 16), 0, 16)
    out = torch._scaled_mm(
        xq,
        w.t(),
        scale_a=input_scale.float().reshape(()),
        scale_b=weight_scale.float().reshape(()),
        out_dtype=out_dtype,
    )
    if w.shape[0] != N:
        out = out[:, :N].contiguous()
    return out if bias is None else out + bias


def check_fp8_experts_args(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    up_input_scale: torch.Tensor,
    down_input_scale: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    E = up.shape[0]
    if up.dtype != FP8_DTYPE or down.dtype != FP8_DTYPE:
        raise ValueError(f"fp8 experts: up/down must be {FP8_DTYPE}, got {up.dtype}/{down.dtype}")
    if (
        up.dim() != 3
        or down.dim() != 3
        or up.shape[2] != x.shape[1]
        or tuple(down.shape) != (E, up.shape[2], up.shape[1])
    ):
        raise ValueError(
            f"fp8 experts: need x [T, d], up [E, I, d], down [E, d, I]; got {tuple(x.shape)}, "
            f"{tuple(up.shape)}, {tuple(down.shape)}"
        )
    if tuple(up_scale.shape) != (E,) or tuple(down_scale.shape) != (E,):
        raise ValueError(
            f"fp8 experts: weight scales must be [E={E}], got {tuple(up_scale.shape)} and {tuple(down_scale.shape)}"
        )
    if up_input_scale.numel() != 1 or down_input_scale.numel() != 1:
        raise ValueError("fp8 experts: up_input_scale and down_input_scale must be scalars (one per GEMM)")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows, x has {x.shape[0]}")


def fp8_moe_experts_ref(
    x: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    up_input_scale: torch.Tensor,
    down_input_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quantize_activations: bool = False,
    *,
    shared_up: Fp8Linear | None = None,
    shared_down: Fp8Linear | None = None,
) -> torch.Tensor:
    """x [T, d] (model dtype), up [E, I, d] / down [E, d, I] e4m3, up_scale / down_scale [E] fp32, input scales fp32
    scalars, topk_weights [T, k] fp32, topk_ids [T, k] -> sum_k w * down(q(relu(up(q(x)))^2)) [T, d] in x's dtype
    (fp32 math on dequantized experts, one at a time; q: fake quantization with the GEMM's input scale when
    quantize_activations, else the identity; the ReLU² output rounds to x's dtype either way, as in the kernel),
    plus the shared expert down(q(relu(up(q(x)))^2)) when shared_up [S, d] and shared_down [d, S] are given (both or
    neither; the math of a routed expert of weight 1, with its own per-tensor scales), summed in fp32, one rounding."""
    check_fp8_experts_args(x, up, down, up_scale, down_scale, up_input_scale, down_input_scale, topk_ids)
    check_fp8_shared(x, shared_up, shared_down)
    quant = fake_quantize_fp8 if quantize_activations else (lambda t, s: t.float())
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=up.shape[0]).tolist()
    tok = order // topk_ids.shape[1]
    w = topk_weights.flatten().float()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        t = tok[start : start + n]
        h = relu2(F.linear(quant(x[t], up_input_scale), up[e].float() * up_scale[e]))
        h = h.to(x.dtype)  # the up GEMM's output rounds to the model dtype (as in the kernels)
        y = F.linear(quant(h, down_input_scale), down[e].float() * down_scale[e])
        out.index_add_(0, t, y * w[start : start + n, None])
        start += n
    if shared_up is not None and shared_down is not None:  # the same math as one routed expert of weight 1
        u, d = shared_up, shared_down
        h = relu2(F.linear(quant(x, u.input_scale), u.weight.float() * u.weight_scale.float())).to(x.dtype)
        out += F.linear(quant(h, d.input_scale), d.weight.float() * d.weight_scale.float())
    return out.to(x.dtype)


def check_fp8_shared(x: torch.Tensor, shared_up: Fp8Linear | None, shared_down: Fp8Linear | None) -> int:
    """The optional FP8 shared expert: both or neither, shared_up [S, d] and shared_down [d, S] e4m3 with scalar
    scales (x [T, d]); returns S, 0 when neither is given."""
    if (shared_up is None) != (shared_down is None):
        raise ValueError("pass both shared_up and shared_down (the FP8 shared expert's linears) or neither")
    if shared_up is None or shared_down is None:
        return 0
    up_w, down_w = shared_up.weight, shared_down.weight
    S = up_w.shape[0]
    if up_w.dim() != 2 or up_w.shape[1] != x.shape[-1] or tuple(down_w.shape) != (x.shape[-1], S):
        raise ValueError(
            f"shared_up must be [S, d] and shared_down [d, S] with d={x.shape[-1]}, got {tuple(up_w.shape)} and "
            f"{tuple(down_w.shape)}"
        )
    check_fp8_linear_args(x.reshape(-1, x.shape[-1]), up_w, shared_up.weight_scale, shared_up.input_scale)
    check_fp8_linear_args(
        up_w.new_empty(0, S, dtype=x.dtype), down_w, shared_down.weight_scale, shared_down.input_scale
    )
    return S
