"""Triton skinny linear (decode GEMV) vs torch's F.linear."""
from __future__ import annotations

import pytest
import torch

from triton_test_util import DEVICE, assert_close, gpu, needs_cuda
from service.engine.kernels.triton_linear import (MAX_SKINNY_ROWS, SkinnyTiles, linear, linear_ref,
                                                  skinny_linear)


def _inputs(M, N, K, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 5, 7), (3, 40, 100), (8, 33, 130), (2, 64, 1030)])
def test_skinny_linear_matches_ref(M, N, K, dtype):
    for bias in (True, False):
        x, w, b = _inputs(M, N, K, dtype, seed=M * N + K, bias=bias)
        y = skinny_linear(x, w, b)
        assert y.dtype == dtype and y.shape == (M, N)
        assert_close(y, linear_ref(x.double(), w.double(), None if b is None else b.double()), dtype, "skinny")


def test_linear_routes_by_rows_and_keeps_leading_dims():
    x, w, b = _inputs(MAX_SKINNY_ROWS + 3, 24, 40, torch.float32, seed=1)
    assert_close(linear(x, w, b), linear_ref(x, w, b), torch.float32, "linear (cuBLAS rows)")
    x3 = x[:6].reshape(2, 3, 40)
    out = linear(x3, w, b)
    assert out.shape == (2, 3, 24)
    assert_close(out, linear_ref(x3, w, b), torch.float32, "linear (skinny rows, 3-d)")
    strided = torch.randn(2, 80, device=DEVICE)[:, :40]          # row stride 80: a split view
    assert_close(linear(strided, w, None), linear_ref(strided, w, None), torch.float32, "linear (strided)")


def test_skinny_linear_refuses_bad_shapes():
    x, w, _ = _inputs(2, 8, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.randn(MAX_SKINNY_ROWS + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="shape"):
        skinny_linear(x, w[:, :8].contiguous())
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(x.half(), w)


NANO_SHAPES = [(10304, 2688), (2688, 4096), (4096, 2688), (3712, 2688), (2688, 3712), (131072, 2688)]


@gpu
@needs_cuda
@pytest.mark.parametrize("N,K", NANO_SHAPES)
@pytest.mark.parametrize("M", [1, 4, 8])
def test_skinny_linear_nano_shapes_gpu(M, N, K):
    x, w, _ = _inputs(M, N, K, torch.bfloat16, seed=N + M)
    ref = linear_ref(x.float(), w.float())
    assert_close(skinny_linear(x, w), ref, torch.bfloat16, "skinny bf16")
    for tiles in (SkinnyTiles(8, 512, 4), SkinnyTiles(16, 256, 4), SkinnyTiles(32, 256, 8)):
        assert_close(skinny_linear(x, w, None, tiles), ref, torch.bfloat16, f"skinny {tiles}")
