"""Triton GEMV (decode linear layers) vs F.linear: 1-4 rows, odd N and K, bias, split-K with the last-arriver
reduction, persistent counters, every tuned launch shape; and the MoE decode tile variants vs moe_experts_ref."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import moe
from service.engine.kernels.linear import gemv_ref
from service.engine.kernels.tiles import (
    GEMV_SHAPES,
    GEMV_TILE_VARIANTS,
    MOE_DECODE_TILE_VARIANTS,
    GemvTiles,
    MoeTiles,
    default_gemv_tiles,
    default_tiles,
)
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import moe_experts_tiled
from tests.kernels.triton_test_util import (
    DEVICE,
    TOL,
    assert_close,
    assert_pdl_chain_bit_equal,
    gpu,
    moe_inputs,
    needs_cuda,
)


def _inputs(M, N, K, dtype, seed, bias=True, row_pad=0):
    """x [M, K] (rows strided by K + row_pad, unit inner stride), weight [N, K] ~ N(0, 1/K), bias [N] or None."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K + row_pad, generator=g, device=DEVICE).to(dtype)[:, row_pad:]
    w = (torch.randn(N, K, generator=g, device=DEVICE) * K**-0.5).to(dtype)
    b = torch.randn(N, generator=g, device=DEVICE).to(dtype) if bias else None
    return x, w, b


def _check(x, w, b, tiles, what, **kw):
    """gemv vs F.linear on the fp32 copies (the error is the kernel's summation order and output rounding)."""
    y = gemv(x, w, b, tiles, **kw)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], w.shape[0])
    ref = gemv_ref(x.float(), w.float(), None if b is None else b.float())
    assert_close(y, ref, x.dtype, what)
    return y


SMALL_TILES = [
    GemvTiles(8, 64, 4),
    GemvTiles(8, 64, 4, False),
    GemvTiles(16, 32, 2, True, 3),
    GemvTiles(4, 128, 4, False, 2),
    GemvTiles(2, 256, 1, True, 4),
]
# (N, K): one element; N and K ragged; N and K even in every tile (no masks: N a multiple of 16, K of 256); K of
# 16 steps of 64 with split-K slices past K; K below every block_k
SMALL_SHAPES = [(1, 1), (37, 100), (16, 256), (5, 1000), (33, 17)]


ROWS_DTYPES = [
    (1, torch.float32),
    (2, torch.float32),
    (3, torch.float32),
    (4, torch.float32),
    (1, torch.float16),
    (3, torch.float16),
    (1, torch.bfloat16),
    (4, torch.bfloat16),
]


@pytest.mark.parametrize("M,dtype", ROWS_DTYPES, ids=str)
@pytest.mark.parametrize("N,K", SMALL_SHAPES)
def test_gemv_matches_ref(N, K, M, dtype):
    """Every small tiling (prefetch on/off, split-K 1-4 incl. slices past K) with and without a bias; rows strided."""
    for bias in (True, False):
        x, w, b = _inputs(M, N, K, dtype, seed=N + K + M, bias=bias, row_pad=3)
        for tiles in SMALL_TILES:
            _check(x, w, b, tiles, f"gemv M={M} N={N} K={K} {tiles} bias={bias}")


def test_gemv_tuned_variants_small():
    """Every tuned launch shape at a small size: K a multiple of block_k (unmasked path) and not; 1 and 3 rows."""
    variants = {t for vs in GEMV_TILE_VARIANTS.values() for t in vs}
    for K in (1024, 300):
        x, w, b = _inputs(3, 45, K, torch.float32, seed=K)
        for tiles in sorted(variants, key=str):
            _check(x[:1], w, None, tiles, f"gemv {tiles} K={K} M=1")
            _check(x, w, b, tiles, f"gemv {tiles} K={K} M=3")


def test_gemv_variant_table():
    """Each Nano shape has 4-8 variants, the first is the default, at least one splits K on the narrow shapes."""
    for name, N, K in GEMV_SHAPES:
        variants = GEMV_TILE_VARIANTS[(N, K)]
        assert 4 <= len(variants) <= 8 and len(set(variants)) == len(variants), name
        assert default_gemv_tiles(N, K) == variants[0]
        if N < 8192:
            assert any(t.split_k > 1 for t in variants), name
    assert default_gemv_tiles(256, 2688).split_k == 4 and default_gemv_tiles(65536, 512).split_k == 1


def test_gemv_split_k_counters_and_determinism():
    """Split-K: a persistent counter buffer is left zeroed (reusable), the result is bit-identical across calls
    and equal to the one with fresh counters (partials are added in split order)."""
    x, w, b = _inputs(2, 50, 300, torch.float32, seed=7)
    tiles = GemvTiles(8, 32, 4, True, 3)
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    first = _check(x, w, b, tiles, "gemv split 3 counters", counters=counters)
    assert not counters.any()
    again = gemv(x, w, b, tiles, counters=counters)
    assert torch.equal(first, again) and torch.equal(first, gemv(x, w, b, tiles)) and not counters.any()


def test_gemv_empty_and_rejects_bad_arguments():
    x, w, b = _inputs(2, 6, 8, torch.float32, seed=1)
    assert gemv(x, w[:0], None).shape == (2, 0)
    torch.testing.assert_close(gemv(x[:, :0], w[:, :0].contiguous(), b), b.expand(2, 6))
    bad = [
        lambda: gemv(torch.randn(5, 8, device=DEVICE), w),  # 5 rows > MAX_ROWS
        lambda: gemv(x, w.t().contiguous().t()),  # weight not contiguous
        lambda: gemv(x, w.half()),  # dtype mismatch
        lambda: gemv(x, w, b[:5]),  # bias shape
        lambda: gemv(x, w[:, :7].contiguous()),  # K mismatch
        lambda: gemv(x.t()[:2], w[:, :2].contiguous()),  # x not unit stride in K
        lambda: gemv(x.long(), w.long()),  # integer dtype
        lambda: gemv(
            torch.ones(1, 64, device=DEVICE),
            torch.ones(6, 64, device=DEVICE),
            None,
            GemvTiles(2, 16, 1, True, 2),
            torch.zeros(2, dtype=torch.int32, device=DEVICE),
        ),  # 3 blocks
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


# ---------------- MoE decode tile variants ----------------
def test_moe_decode_tile_variants_small():
    """Every decode variant at a small size (fp32 'ieee' dots in the interpreter); the first is the default."""
    assert default_tiles(6 / 128, 2) == MOE_DECODE_TILE_VARIANTS[0] == MoeTiles(16, 64, 128, 4, 4)
    args = moe_inputs(3, 8, 2, 40, 72, torch.float32, seed=3)
    for tiles in MOE_DECODE_TILE_VARIANTS:
        assert_close(moe_experts_tiled(*args, tiles), moe.moe_experts_ref(*args), torch.float32, f"moe {tiles}")


# ---------------- GPU, Nano-30B-A3B shapes ----------------
GPU_CASES = [(name, N, K, t) for name, N, K in GEMV_SHAPES for t in GEMV_TILE_VARIANTS[(N, K)]]


@gpu
@needs_cuda
@pytest.mark.parametrize("name,N,K,tiles", GPU_CASES, ids=[f"{c[0]}-{c[3]}" for c in GPU_CASES])
def test_gemv_gpu_nano_variants(name, N, K, tiles):
    """Every variant the gemv benchmark times, bf16 at M = 1 (decode) and M = 4 with a bias, vs fp32 F.linear."""
    x, w, b = _inputs(4, N, K, torch.bfloat16, seed=N + K)
    _check(x[:1], w, None, tiles, f"gemv {name} {tiles} M=1")
    _check(x, w, b, tiles, f"gemv {name} {tiles} M=4")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_gpu_dtypes(dtype):
    x, w, b = _inputs(2, 4096, 2688, dtype, seed=5)
    for tiles in (GemvTiles(8, 256, 4), GemvTiles(8, 128, 4, True, 3)):
        _check(x, w, b, tiles, f"gemv {dtype} {tiles}")


@gpu
@needs_cuda
@pytest.mark.parametrize("persistent", [False, True])
def test_gemv_gpu_cuda_graph(persistent):
    """Split-K gemv captured in a CUDA graph (no host sync: sync debug mode errors on one), replayed on new x:
    right results every replay (the arrival counters are zeroed again, by the memset or by the kernel)."""
    x, w, _ = _inputs(1, 2688, 4096, torch.bfloat16, seed=9)
    tiles = GemvTiles(8, 512, 4, True, 2)
    counters = torch.zeros(336, dtype=torch.int32, device=DEVICE) if persistent else None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemv(x, w, None, tiles, counters)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        gemv(x, w, None, tiles, counters)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(x, w, None, tiles, counters)
    for seed in (1, 2, 3):
        x.copy_(_inputs(1, 1, 4096, torch.bfloat16, seed=seed)[0])
        graph.replay()
        err = ((y.double() - gemv_ref(x.float(), w.float()).double()).norm() / y.double().norm()).item()
        assert err <= TOL[torch.bfloat16], err
    assert counters is None or not counters.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", MOE_DECODE_TILE_VARIANTS, ids=str)
@pytest.mark.parametrize("T", [1, 8, 64])
def test_moe_decode_tile_variants_gpu_nano(T, tiles):
    """Every decode variant the moe_tune benchmark times, Nano's E 128, top-6, d 2688, I 1856, bf16."""
    args = moe_inputs(T, 128, 6, 2688, 1856, torch.bfloat16, seed=T)
    assert_close(moe_experts_tiled(*args, tiles), moe.moe_experts_ref(*args), torch.bfloat16, f"moe T={T} {tiles}")


def test_linear_dispatch_by_shape():
    """`triton_gemv.linear`: one row on a small weight runs gemv (bit-equal to it), more rows or a weight above
    MAX_GEMV_WEIGHT_ELEMENTS run F.linear (bit-equal to it); both match the reference."""
    from service.engine.kernels.triton_gemv import linear

    g = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=g).to(DEVICE)
    b = torch.randn(24, generator=g).to(DEVICE)
    x1 = torch.randn(1, 1, 40, generator=g).to(DEVICE)
    out = linear(x1, w, b)
    assert out.shape == (1, 1, 24)
    assert torch.equal(out.view(1, 24), gemv(x1.view(1, 40), w, b))
    x3 = torch.randn(3, 40, generator=g).to(DEVICE)
    assert torch.equal(linear(x3, w, b), torch.nn.functional.linear(x3, w, b))
    from service.engine.kernels.triton_gemv import MAX_GEMV_WEIGHT_ELEMENTS

    big = torch.randn(MAX_GEMV_WEIGHT_ELEMENTS // 64 + 1, 64, generator=g).to(DEVICE)
    xb = torch.randn(1, 64, generator=g).to(DEVICE)
    assert torch.equal(linear(xb, big), torch.nn.functional.linear(xb, big))
    for y, x in ((out.view(1, 24), x1.view(1, 40)), (linear(x3, w, b), x3)):
        assert (y - gemv_ref(x, w, b)).abs().max() <= 1e-4 * gemv_ref(x, w, b).abs().max()


def test_use_pdl_only_on_cuda():
    """Programmatic dependent launch is chosen by the tensor's device: never for CPU tensors (the interpreter)."""
    from service.engine.kernels.triton_common import use_pdl

    assert not use_pdl(torch.zeros(1))
    if torch.cuda.is_available():
        assert use_pdl(torch.zeros(1, device="cuda")) == (torch.cuda.get_device_capability()[0] >= 9)


@gpu
@needs_cuda
def test_gemv_gpu_pdl_chain_in_graph():
    """A chain of dependent GEMVs (each reads the one before's output, 20 MB weights: no link fits in L2) captured
    in a CUDA graph with PDL and without: bit-equal outputs on every replay with new inputs, and equal to the
    eager chain. A PDL kernel reading its input before the previous kernel finished would break this."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    ws = [
        (torch.randn((3712, 2688) if i % 2 == 0 else (2688, 3712), generator=g, device=DEVICE) * 0.02).to(
            torch.bfloat16
        )
        for i in range(12)
    ]
    x = torch.randn(1, 2688, generator=g, device=DEVICE).to(torch.bfloat16)

    def chain(pdl: bool) -> torch.Tensor:
        y = x
        for w in ws:
            y = gemv(y, w, pdl=pdl)
        return y

    assert_pdl_chain_bit_equal(
        chain, lambda: x.copy_(torch.randn(1, 2688, generator=g, device=DEVICE).to(torch.bfloat16))
    )
