"""Triton FP8 activation quantization and the FP8 linear of the Triton bundle.

- `quantize_fp8`: x / scale clamped to +-448 and rounded to e4m3 in one launch, bit-equal to torch's cast
  (`f32_to_e4m3_bits`, integer operations: the same on the GPU and in the Triton interpreter); the W8A8 GEMMs' input.
- `fp8_linear`: a single row (batch-1 decode) runs the FP8 `triton_gemv.gemv` (weight-only), more rows W8A8 on FP8
  tensor cores (`quantize_fp8` + `fp8.scaled_mm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels import fp8
from service.engine.kernels.tiles import QUANTIZE_TILE_VARIANTS, QuantizeTiles
from service.engine.kernels.triton_common import check_dim, check_inner_contiguous, check_same_device
from service.engine.kernels.triton_gemv import MAX_GEMV_WEIGHT_ELEMENTS, gemv

FP8_MAX: tl.constexpr = tl.constexpr(fp8.FP8_MAX)


@triton.jit
def f32_to_e4m3_bits(v):
    """fp32 values in [-448, 448] -> their float8_e4m3fn bit patterns (int32 in 0..255), rounded to nearest even
    as torch's cast: integer operations on the fp32 bits (the same on the GPU and in the Triton interpreter, whose
    float8 cast drops mantissa carries). Normal range: re-biased exponent and the mantissa's top 3 bits, rounded;
    below 2^-6: the subnormal count of 2^-9 steps, rounded (8 steps carry into the smallest normal's pattern)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    norm = mag - (120 << 23)  # exponent bias 127 -> 7
    rn = (norm + 0x7FFFF + ((norm >> 20) & 1)) >> 20
    m = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (mag >> 23), 31)  # |v| * 2^9 = m * 2^-shift
    rs = (m + ((1 << (shift - 1)) - 1) + ((m >> shift) & 1)) >> shift
    return sign | tl.where(mag >= (121 << 23), rn, rs)


@triton.jit(do_not_specialize=("n_rows",))  # per-step sizes: triton_common's docstring
def _quantize_kernel(x_ptr, scale_ptr, q_ptr, n_rows, n_cols, s_x, s_q, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of block program_id(0), columns of block program_id(1): q = e4m3 bits of clamp(x / scale, +-448)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    offs = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (rows < n_rows) & (offs < n_cols)
    v = tl.load(x_ptr + rows * s_x + offs, mask=m, other=0.0).to(tl.float32) / tl.load(scale_ptr)
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + rows * s_q + offs, f32_to_e4m3_bits(v).to(tl.uint8), mask=m)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`fp8.quantize_fp8` in one launch: x [T, K] (unit stride in K), scale fp32 (one element) ->
    float8_e4m3fn [T, K] contiguous, equal to torch's clamp(x / scale, +-448) cast bit for bit."""
    return quantize_fp8_tiled(x, scale, None)


def quantize_fp8_tiled(x: torch.Tensor, scale: torch.Tensor, tiles: QuantizeTiles | None) -> torch.Tensor:
    """`quantize_fp8` with a given launch shape (None: the first of `QUANTIZE_TILE_VARIANTS`)."""
    check_dim("x", x, 2)
    check_inner_contiguous("x", x)
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"the input scale must be one fp32 element, got {scale.dtype} {tuple(scale.shape)}")
    check_same_device(x=x, scale=scale)
    q = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if x.numel():
        t = tiles or QUANTIZE_TILE_VARIANTS[0]
        block = min(t.block, triton.next_power_of_2(x.shape[1]))
        _quantize_kernel[(triton.cdiv(x.shape[0], t.rows), triton.cdiv(x.shape[1], block))](
            x, scale, q, x.shape[0], x.shape[1], x.stride(0), q.stride(0), ROWS=t.rows, BLOCK=block, num_warps=t.warps
        )
    return q.view(fp8.FP8_DTYPE)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """An FP8 linear (`fp8.fp8_linear_ref` signature) for x [..., K]: a single row (batch-1 decode) on a weight of
    <= MAX_GEMV_WEIGHT_ELEMENTS runs the FP8 `gemv` (weight-only: x is not quantized, input_scale is checked and
    not used; one launch), every other case W8A8 on FP8 tensor cores: x quantized by `quantize_fp8` (one launch),
    then `fp8.scaled_mm`. Chosen by shape alone."""
    K = x.shape[-1]
    if x.numel() == K and weight.numel() <= MAX_GEMV_WEIGHT_ELEMENTS and weight.is_contiguous():
        fp8.check_fp8_linear_args(x.reshape(1, K), weight, weight_scale, input_scale)
        y = gemv(x.reshape(1, K), weight, bias, counters=counters, weight_scale=weight_scale.float().reshape(1))
        return y.view(*x.shape[:-1], weight.shape[0])
    x2 = x.reshape(-1, K)
    fp8.check_fp8_linear_args(x2, weight, weight_scale, input_scale)
    xq = quantize_fp8(x2, input_scale.float().reshape(1))
    return fp8.scaled_mm(xq, weight, weight_scale, input_scale, bias, x.dtype).view(*x.shape[:-1], -1)
