"""Triton write of new K/V rows into the paged KV caches: both caches in one launch, PDL on Hopper+.

Same signature and semantics as `attention.write_kv_ref` (token t's K/V land in cache row `slot_mapping[t]`, cast
to the cache's dtype; with k_scale / v_scale divided by them (IEEE division); into an FP8 cache clamped to +-448).
k and v may be strided views (heads and tokens; unit stride in the head dim), e.g. the column splits of the fused
q/k/v projection's output. One program per token writes all its heads of K and of V.
Into an FP8 cache the kernel encodes the e4m3 bytes itself (round half to even, as torch's cast; subnormals kept)
and stores them through a uint8 view of the cache: no fp32 -> fp8 conversion instruction is involved, so the bits
are the same on every GPU and in Triton's interpreter (whose fp32 -> fp8 cast does not carry a rounding into the
exponent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from service.engine.kernels.triton_common import (
    block_dim,
    check_dim,
    check_inner_contiguous,
    check_same_device,
    check_shape,
    pdl_args,
    pdl_release,
    pdl_wait,
)


@triton.jit
def _pow2(k):
    """2**k as fp32 for integer k in [-126, 127] (exact, from the exponent bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bytes(x):
    """fp32 x with |x| <= 448 -> the float8_e4m3fn byte of its nearest value (ties to even), as int32. With x's
    binary exponent e (at least -6) the grid step is 2**(e - 3): r = |x| / step rounded is 8..16 for normal numbers
    (16: the rounding carried into the next exponent) and 0..8 below 2**-6 (subnormals, exponent field 0)."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    y = tl.abs(x) * _pow2(3 - e)  # |x| in grid steps (exact: a power-of-two scaling)
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where((r - y == 0.5) & odd, r - 1.0, r).to(tl.int32)
    carry = r == 16
    e = tl.where(carry, e + 1, e)
    r = tl.where(carry, 8, r)
    code = tl.where(r >= 8, ((e + 7) << 3) | (r - 8), r)  # normal: biased exponent e + 7, mantissa r - 8
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def _stored(x, scale_ptr, SCALED: tl.constexpr, FP8: tl.constexpr):
    """x as the cache stores it: / scale when SCALED; for an FP8 cache (viewed as uint8) its e4m3 bytes, saturated
    at +-448."""
    if SCALED:
        x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
    if FP8:
        x = _e4m3_bytes(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    return x


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    H,
    D,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_kct,
    s_kch,
    s_vct,
    s_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < H) & (d < D)
    pdl_wait(PDL)  # k, v and the slots come from earlier kernels / copies
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=m)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=m)
    pdl_release(PDL)
    k = _stored(k, ks_ptr, SCALED, FP8)
    v = _stored(v, vs_ptr, SCALED, FP8)
    tl.store(kc_ptr + slot * s_kct + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + slot * s_vct + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=m)


def check_kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether KV scales are given: both (each an fp32 one-element tensor on the cache's device) or neither."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("give both k_scale and v_scale, or neither")
    if k_scale is None:
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != cache.device:
            raise ValueError(
                f"{name} must be a one-element float32 tensor on {cache.device}, got shape {tuple(s.shape)} "
                f"{s.dtype} on {s.device}"
            )
    return True


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v [T, Hkv, Dh] (unit stride in Dh) written to k_cache, v_cache [S, Hkv, Dh] (unit stride in Dh) at rows
    slot_mapping [T] (int32/int64, each in [0, S); not checked on the device), cast to the caches' dtype.
    k_scale, v_scale: fp32 one-element tensors on the caches' device (both or neither): the caches store k / k_scale
    and v / v_scale."""
    check_dim("k_cache", k_cache, 3)
    S, H, D = k_cache.shape
    check_shape("v_cache", v_cache, (S, H, D))
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    check_dim("k", k, 3)
    T = k.shape[0]
    check_shape("k", k, (T, H, D))
    check_shape("v", v, (T, H, D))
    check_shape("slot_mapping", slot_mapping, (T,))
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        check_inner_contiguous(name, t)
    check_same_device(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    scaled = check_kv_scales(k_cache, k_scale, v_scale)
    if T == 0:
        return
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _write_kv_kernel[(T,)](
        k,
        v,
        k_cache.view(torch.uint8) if fp8 else k_cache,
        v_cache.view(torch.uint8) if fp8 else v_cache,
        slot_mapping.contiguous(),
        k_scale if scaled else slot_mapping,
        v_scale if scaled else slot_mapping,
        H,
        D,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        BLOCK_H=block_dim(H, 1),
        BLOCK_D=block_dim(D, 1),
        SCALED=scaled,
        FP8=fp8,
        num_warps=1,
        **pdl_args(k),
    )
