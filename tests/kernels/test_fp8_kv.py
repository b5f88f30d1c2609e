"""FP8 KV cache (float8_e4m3fn pages with per-layer k_scale / v_scale): the write path quantizes, every attention
kernel (Triton prefill and decode, the CPU kernel) dequantizes on load; each against the torch reference, and the
reference against torch's own float8 cast and SDPA on the dequantized caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.engine.kernels import attention, cpu_attention
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from service.engine.kernels.tiles import DecodeTiles, PrefillTiles
from service.engine.kernels.triton_attention import paged_attention, paged_attention_tiled
from service.engine.kernels.triton_kv import write_kv
from tests.kernels.test_triton_attention import CPU_CASES, _setup
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _scales(k_amax: float, v_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(k_amax / FP8_MAX, device=DEVICE), torch.tensor(v_amax / FP8_MAX, device=DEVICE))


def _fp8_setup(qlens, plens, Hq, Hkv, Dh, page_size, dtype, seed, k_amax=6.0, v_amax=3.0):
    """_setup's inputs with its caches scaled by (k_amax, v_amax) / 4 and stored in FP8 with scales amax / 448
    (so a few values saturate): (args for paged attention, k_scale, v_scale)."""
    args = list(_setup(qlens, plens, Hq, Hkv, Dh, page_size, dtype, seed))
    ks, vs = _scales(k_amax, v_amax)
    args[1] = attention.kv_stored(args[1].float() * (k_amax / 4), FP8_DTYPE, ks)
    args[2] = attention.kv_stored(args[2].float() * (v_amax / 4), FP8_DTYPE, vs)
    return args, ks, vs


# ---------------------------------------------------------------- the write path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [True, False])
def test_write_kv_fp8_bits_equal_ref(dtype, scaled):
    """Triton's write quantizes to the same e4m3 bits as the reference (x / scale, saturated at +-448), over values
    from the subnormal range to past the saturation point, and leaves other rows untouched."""
    g = torch.Generator().manual_seed(1)
    T, S, H, D = 37, 64, 2, 16
    mag = torch.logspace(-4, 3.2, T * H * D).view(T, H, D)  # 1e-4 .. 1600 (past 448 * scale)
    sign = torch.randint(0, 2, (T, H, D), generator=g) * 2 - 1
    k = (mag * sign).to(DEVICE, dtype)
    v = (-k.float() * 0.7).to(dtype)
    slots = torch.randperm(S, generator=g)[:T].to(DEVICE)
    init = torch.randn(S, H, D, generator=g).to(DEVICE, FP8_DTYPE)
    ks, vs = _scales(900.0, 600.0) if scaled else (None, None)
    ours, ref = [init.clone(), init.clone()], [init.clone(), init.clone()]
    write_kv(ours[0], ours[1], k, v, slots, ks, vs)
    attention.write_kv_ref(ref[0], ref[1], k, v, slots, ks, vs)
    assert torch.equal(_bits(ours[0]), _bits(ref[0])) and torch.equal(_bits(ours[1]), _bits(ref[1]))
    stored = ours[0][slots].float()
    assert torch.isfinite(stored).all() and stored.abs().max() == FP8_MAX  # saturated, not inf / nan


def test_write_kv_ref_is_torchs_cast():
    """The reference stores exactly torch's float8 cast of clamp(x / scale) and reads back within e4m3's rounding
    (half a step: 2**-4 relative for normal values)."""
    x = torch.randn(50, 2, 8) * 3
    scale = torch.tensor(0.05)  # 448 * 0.05 = 22.4: no value saturates
    cache = torch.zeros(64, 2, 8, dtype=FP8_DTYPE)
    slots = torch.arange(50)
    attention.write_kv_ref(cache, cache.clone(), x, x, slots, scale, scale)
    assert torch.equal(_bits(cache[slots]), _bits((x / scale).clamp(-448, 448).to(FP8_DTYPE)))
    back = attention.kv_loaded(cache[slots], scale)
    normal = (x / scale).abs() >= 2**-6
    assert ((back - x).abs()[normal] <= (x.abs() * 2**-4)[normal] + 1e-7).all()


def test_write_kv_scales_checked():
    cache = torch.zeros(8, 1, 16, dtype=FP8_DTYPE)
    k = torch.zeros(2, 1, 16)
    slots = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        write_kv(cache, cache.clone(), k, k, slots, torch.tensor(1.0), None)
    with pytest.raises(ValueError, match="one-element float32"):
        write_kv(cache, cache.clone(), k, k, slots, torch.ones(2), torch.ones(2))


# ---------------------------------------------------------------- attention reads
def test_ref_dequantizes_on_load():
    """The reference on FP8 caches equals SDPA over the dequantized (cache * scale) caches, causal per request."""
    args, ks, vs = _fp8_setup([5, 1], [3, 9], Hq=4, Hkv=2, Dh=16, page_size=4, dtype=torch.float32, seed=3)
    out = attention.paged_attention_ref(*args, ks, vs)
    q, kc, vc, table = args[0], args[1].float() * ks, args[2].float() * vs, args[3]
    for i, (start, n, p) in enumerate(((0, 5, 3), (5, 1, 9))):
        L = p + n
        slots = table[i, torch.arange(L) // 4] * 4 + torch.arange(L) % 4
        mask = torch.arange(L)[None, :] <= p + torch.arange(n)[:, None]
        expect = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            kc[slots].transpose(0, 1).repeat_interleave(2, 0),
            vc[slots].transpose(0, 1).repeat_interleave(2, 0),
            attn_mask=mask,
            scale=16**-0.5,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_triton_attention_fp8_cache_matches_ref(case, dtype):
    qlens, plens = CPU_CASES[case]
    args, ks, vs = _fp8_setup(qlens, plens, Hq=4, Hkv=2, Dh=16, page_size=4, dtype=dtype, seed=case)
    out = paged_attention(*args, ks, vs)
    assert out.dtype == dtype
    assert_close(out, attention.paged_attention_ref(*args, ks, vs), dtype, "fp8-cache attention")


@pytest.mark.parametrize("split", [True, False])
def test_triton_decode_fp8_cache_matches_ref(split):
    """Decode with split-KV partials (v_scale applied before the merge) and without."""
    tiles = DecodeTiles(16, 4, 2, programs=64 if split else 4, min_split=16)
    args, ks, vs = _fp8_setup([1] * 3, [0, 37, 300], Hq=8, Hkv=2, Dh=16, page_size=4, dtype=torch.float16, seed=9)
    out = paged_attention_tiled(*args, PrefillTiles(), tiles, k_scale=ks, v_scale=vs)
    assert_close(out, attention.paged_attention_ref(*args, ks, vs), torch.float16, f"decode split={split}")


def test_triton_attention_fp8_cache_unit_scales():
    """An FP8 cache without scales reads as scale 1."""
    args, ks, vs = _fp8_setup([4, 1], [2, 6], Hq=4, Hkv=2, Dh=16, page_size=4, dtype=torch.float32, seed=4)
    assert_close(paged_attention(*args), attention.paged_attention_ref(*args), torch.float32, "unit scales")
    ones = torch.ones((), device=DEVICE)
    assert_close(paged_attention(*args), attention.paged_attention_ref(*args, ones, ones), torch.float32, "ones")


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_cpu_attention_fp8_cache_matches_ref(case):
    qlens, plens = CPU_CASES[case]
    args, ks, vs = _fp8_setup(qlens, plens, Hq=4, Hkv=2, Dh=16, page_size=4, dtype=torch.float32, seed=case)
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    ks, vs = ks.cpu(), vs.cpu()
    ref = attention.paged_attention_ref(*args, ks, vs)
    assert_close(cpu_attention.paged_attention(*args, ks, vs), ref, torch.float32, "cpu fp8-cache attention")
    unit = attention.paged_attention_ref(*args)
    assert_close(cpu_attention.paged_attention(*args), unit, torch.float32, "cpu fp8-cache attention, no scales")


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "qlens, plens, page", [([1] * 64, [2047] * 64, 64), ([1000, 37, 1, 4096], [300, 0, 50, 0], 16), ([1], [8191], 64)]
)
def test_fp8_cache_gpu_nano_shapes(qlens, plens, page):
    """Nano attention shapes (32 q / 2 KV heads x 128), bf16 queries, FP8 caches: Triton write + attention vs ref."""
    args, ks, vs = _fp8_setup(qlens, plens, Hq=32, Hkv=2, Dh=128, page_size=page, dtype=torch.bfloat16, seed=page)
    assert_close(
        paged_attention(*args, ks, vs), attention.paged_attention_ref(*args, ks, vs), torch.bfloat16, "attention"
    )
    k = torch.randn(4096, 2, 128, device=DEVICE, dtype=torch.bfloat16) * 2
    slots = torch.randperm(args[1].shape[0], device=DEVICE)[:4096]
    ours, ref = [args[1].clone(), args[2].clone()], [args[1].clone(), args[2].clone()]
    write_kv(ours[0], ours[1], k, -k, slots, ks, vs)
    attention.write_kv_ref(ref[0], ref[1], k, -k, slots, ks, vs)
    assert torch.equal(_bits(ours[0]), _bits(ref[0])) and torch.equal(_bits(ours[1]), _bits(ref[1]))
