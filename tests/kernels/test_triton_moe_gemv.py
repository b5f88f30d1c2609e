"""Grouped-GEMV MoE experts (batch-1/2 decode) vs the torch reference and the tiled Triton path."""
from __future__ import annotations

import pytest
import torch

from triton_test_util import DEVICE, assert_close, gpu, moe_inputs, needs_cuda
from service.engine.kernels import moe
from service.engine.kernels.triton_moe import moe_experts
from service.engine.kernels.triton_moe_gemv import (EXPERT_GEMV_TILE_VARIANTS, MAX_GEMV_PAIRS, ExpertGemvTiles,
                                                    moe_experts_gemv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,k,d,inter", [(1, 6, 40, 24), (2, 3, 33, 70), (1, 1, 700, 9), (2, 8, 16, 130)])
def test_moe_experts_gemv_matches_ref(T, k, d, inter, dtype):
    args = moe_inputs(T, E=12, k=k, d=d, inter=inter, dtype=dtype, seed=T * 100 + d)
    for tiles in (None, ExpertGemvTiles(8, 64, 4), ExpertGemvTiles(4, 64, 2)):
        out = moe_experts_gemv(*args, tiles)
        assert out.dtype == dtype and out.shape == (T, d)
        assert_close(out, moe.moe_experts_ref(*args), dtype, f"moe_experts_gemv {tiles}")
        assert_close(out, moe_experts(*args), dtype, "moe_experts_gemv vs tiled")


def test_moe_experts_gemv_repeated_expert_and_limits():
    """Both slots of a token on one expert (weights summed), T = 0, and a batch above the pair limit."""
    x, up, down, _, _ = moe_inputs(2, E=4, k=2, d=24, inter=20, dtype=torch.float32, seed=3)
    ids = torch.tensor([[1, 1], [3, 0]], device=DEVICE)
    w = torch.tensor([[0.25, 0.5], [1.0, 2.0]], device=DEVICE)
    assert_close(moe_experts_gemv(x, up, down, w, ids), moe.moe_experts_ref(x, up, down, w, ids), torch.float32,
                 "repeated expert")
    assert moe_experts_gemv(x[:0], up, down, w[:0], ids[:0]).shape == (0, 24)
    many = MAX_GEMV_PAIRS // 2 + 1
    with pytest.raises(ValueError, match="pairs"):
        moe_experts_gemv(x[:1].expand(many, 24), up, down, w[:1].expand(many, 2), ids[:1].expand(many, 2))


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", EXPERT_GEMV_TILE_VARIANTS, ids=str)
@pytest.mark.parametrize("T", [1, 2])
def test_moe_experts_gemv_gpu_nano(T, tiles):
    args = moe_inputs(T, E=128, k=6, d=2688, inter=1856, dtype=torch.bfloat16, seed=T)
    out = moe_experts_gemv(*args, tiles)
    assert_close(out, moe.moe_experts_ref(*args), torch.bfloat16, f"moe_experts_gemv {tiles}")
