"""Triton write of new K/V rows into the paged KV caches: both caches in one launch, PDL on Hopper+.

Same signature and semantics as `attention.write_kv_ref` (token t's K/V land in cache row `slot_mapping[t]`, cast
to the cache's dtype). k and v may be strided views (heads and tokens; unit stride in the head dim), e.g. the
column splits of the fused q/k/v projection's output. One program per token writes all its heads of K and of V.
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
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
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
    tl.store(kc_ptr + slot * s_kct + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + slot * s_vct + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=m)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v [T, Hkv, Dh] (unit stride in Dh) written to k_cache, v_cache [S, Hkv, Dh] (unit stride in Dh) at rows
    slot_mapping [T] (int32/int64, each in [0, S); not checked on the device), cast to the caches' dtype."""
    check_dim("k_cache", k_cache, 3)
    S, H, D = k_cache.shape
    check_shape("v_cache", v_cache, (S, H, D))
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
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
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
        num_warps=1,
        **pdl_args(k),
    )
