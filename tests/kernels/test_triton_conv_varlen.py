"""Triton varlen causal conv1d (sliding-window kernel) vs the torch reference: tilings that put token-block starts
at every position of a request, request starts inside unrolled steps, empty requests, and every tuned variant."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import conv1d
from service.engine.kernels.tiles import CONV_TILE_VARIANTS, ConvTiles
from service.engine.kernels.triton_conv1d import causal_conv1d_varlen, causal_conv1d_varlen_tiled
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda


def _inputs(qlens, Dm, K, dtype, seed, with_bias=True):
    """Packed x with strided rows (a split of a wider projection), nonzero initial states, qlens may hold zeros."""
    g = torch.Generator().manual_seed(seed)
    T = sum(qlens)
    x = torch.randn(T, Dm + 5, generator=g).to(DEVICE, dtype)[:, 2 : 2 + Dm]
    weight = (torch.randn(Dm, K, generator=g) * 0.5).to(DEVICE, dtype)
    bias = torch.randn(Dm, generator=g).to(DEVICE, dtype) if with_bias else None
    init = torch.randn(len(qlens), Dm, K - 1, generator=g).to(DEVICE, dtype)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), device=DEVICE)
    token_req = torch.repeat_interleave(torch.arange(len(qlens)), torch.tensor(qlens)).to(DEVICE)
    return x, weight, bias, init, qsl, token_req


SMALL_TILES = [ConvTiles(4, 16, 1, 2), ConvTiles(8, 32, 1, 4), ConvTiles(3, 16, 1, 1), ConvTiles(16, 64, 2, 8)]
QLENS = [
    [5, 1, 2, 9, 3, 13],  # short requests: starts at every offset of a step and of a token block
    [3, 0, 21, 0, 1],  # empty requests between others
    [37],  # one request over many blocks: blocks start at j = 4, 8, ... (window from x)
    [1, 1, 1, 1, 1, 1, 1],  # decode-like rows: every token starts a request
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiles", SMALL_TILES, ids=str)
@pytest.mark.parametrize("case", range(len(QLENS)))
def test_conv_varlen_tilings_match_ref(case, tiles, dtype):
    args = _inputs(QLENS[case], 40, 4, dtype, seed=case)
    out = causal_conv1d_varlen_tiled(*args, tiles)
    assert out.dtype == dtype
    assert_close(out, conv1d.causal_conv1d_varlen_ref(*args), dtype, f"conv varlen {tiles}")


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_varlen_narrow_widths_match_ref(K, with_bias):
    """Widths below 4: the unused window rows and weight columns are zeros."""
    args = _inputs([6, 2, 11, 1], 24, K, torch.float32, seed=K, with_bias=with_bias)
    for tiles in (ConvTiles(4, 16, 1, 2), ConvTiles(8, 32, 1, 8)):
        assert_close(
            causal_conv1d_varlen_tiled(*args, tiles),
            conv1d.causal_conv1d_varlen_ref(*args),
            torch.float32,
            f"conv varlen K={K} {tiles}",
        )


def test_conv_varlen_state_in_another_dtype():
    """fp32 initial states with fp16 x: the state is rounded to x's dtype, as in the reference."""
    x, weight, bias, init, qsl, token_req = _inputs([2, 7, 1], 32, 4, torch.float16, seed=3)
    init = torch.randn(init.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    args = (x, weight, bias, init, qsl, token_req)
    assert_close(
        causal_conv1d_varlen_tiled(*args, ConvTiles(4, 16, 1, 2)),
        conv1d.causal_conv1d_varlen_ref(*args),
        torch.float16,
        "conv varlen fp32 state",
    )


def test_conv_varlen_rejects_bad_tiles_and_widths():
    args = _inputs([3, 2], 16, 4, torch.float32, seed=0)
    with pytest.raises(ValueError, match="rows"):
        causal_conv1d_varlen_tiled(*args, ConvTiles(6, 16, 1, 4))
    with pytest.raises(ValueError, match="powers of two"):
        causal_conv1d_varlen_tiled(*args, ConvTiles(6, 16, 1, 3))
    wide = _inputs([3, 2], 16, 5, torch.float32, seed=0)
    with pytest.raises(ValueError, match="width"):
        causal_conv1d_varlen(*wide)


def test_conv_tile_variants_are_valid():
    """Every tuned variant: block_t a multiple of rows, powers of two (checked without a GPU)."""
    assert CONV_TILE_VARIANTS[0] == ConvTiles()
    args = _inputs([5, 3], 16, 4, torch.float32, seed=1)
    for tiles in CONV_TILE_VARIANTS:
        assert_close(
            causal_conv1d_varlen_tiled(*args, tiles),
            conv1d.causal_conv1d_varlen_ref(*args),
            torch.float32,
            f"conv varlen {tiles}",
        )


NANO_QLENS = [[8192], [2 * 128 + 3, 1, 1000, 2, 0, 517]]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles", CONV_TILE_VARIANTS, ids=str)
@pytest.mark.parametrize("case", range(len(NANO_QLENS)))
def test_conv_varlen_variants_gpu_nano_shapes(case, tiles, dtype):
    """Every variant the tune benchmark may pick, at Nano's conv_dim 6144, width 4, vs the reference."""
    args = _inputs(NANO_QLENS[case], 64 * 64 + 2 * 8 * 128, 4, dtype, seed=30 + case)
    assert_close(
        causal_conv1d_varlen_tiled(*args, tiles), conv1d.causal_conv1d_varlen_ref(*args), dtype, f"conv varlen {tiles}"
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_bundle_conv_windows_gpu_equal_ref(dtype):
    """The triton bundle's conv_windows (the torch bundle's row gather) equals the reference bit for bit on the
    GPU: states after 0, 1, some and all new tokens of each request, Nano's conv width and channels."""
    from service.engine.kernels.triton_backend import triton_kernels

    x, _, _, init, qsl, _ = _inputs([700, 1, 3, 1024], 6144, 4, dtype, seed=3)
    req = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3], device=DEVICE)
    new = torch.tensor([0, 2, 700, 0, 1, 2, 3, 5, 1024], device=DEVICE)
    out = triton_kernels().conv_windows(x, init, qsl, req, new)
    assert torch.equal(out, conv1d.conv_state_windows_ref(x, init, qsl, req, new))
