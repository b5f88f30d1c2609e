"""Triton MoE experts (sorted-token grouped GEMMs) vs the torch reference."""
from __future__ import annotations

import pytest
import torch

from triton_test_util import DEVICE, assert_close, gpu, needs_cuda
from service.engine.kernels import moe
from service.engine.kernels.triton_moe import align_by_expert, moe_experts


def _inputs(T, E, k, d, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(DEVICE, dtype)
    up = (torch.randn(E, inter, d, generator=g) * d ** -0.5).to(DEVICE, dtype)
    down = (torch.randn(E, d, inter, generator=g) * inter ** -0.5).to(DEVICE, dtype)
    gate = torch.randn(E, d, generator=g).to(DEVICE)
    bias = (torch.randn(E, generator=g) * 0.1).to(DEVICE)
    weights, ids = moe.moe_route_ref(x, gate, bias, k, 1, 1, True, 2.5)
    return x, up, down, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 40, 200])
def test_moe_experts_matches_ref(T, dtype):
    args = _inputs(T, E=8, k=2, d=32, inter=48, dtype=dtype, seed=T)
    out = moe_experts(*args)
    assert out.dtype == dtype
    assert_close(out, moe.moe_experts_ref(*args), dtype, "moe_experts")


def test_moe_experts_skewed_routing():
    """Every token on one expert (others empty), top_k = 1."""
    x, up, down, _, _ = _inputs(37, E=8, k=2, d=32, inter=48, dtype=torch.float32, seed=1)
    ids = torch.full((37, 1), 5, dtype=torch.int64, device=DEVICE)
    w = torch.rand(37, 1, device=DEVICE)
    assert_close(moe_experts(x, up, down, w, ids), moe.moe_experts_ref(x, up, down, w, ids), torch.float32, "moe")


def test_align_by_expert_groups_every_pair_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [7, 3]], device=DEVICE)
    al = align_by_expert(ids, num_experts=8, block_m=4)
    pairs = al.sorted_pairs.view(-1, 4).cpu()
    experts = al.block_expert.cpu()
    seen = []
    for blk, e in zip(pairs.tolist(), experts.tolist()):
        real = [p for p in blk if p < ids.numel()]
        if e < 0:
            assert not real
            continue
        assert real and all(ids.flatten()[p].item() == e for p in real)
        seen += real
    assert sorted(seen) == list(range(ids.numel()))
    assert experts.tolist()[:4] == [0, 1, 3, 7]


@gpu
@needs_cuda
@pytest.mark.parametrize("T,dtype", [(1, torch.bfloat16), (128, torch.bfloat16), (2048, torch.bfloat16),
                                     (128, torch.float32), (2048, torch.float32)])
def test_moe_experts_gpu_nano_shapes(T, dtype):
    args = _inputs(T, E=128, k=6, d=2688, inter=1856, dtype=dtype, seed=T)
    assert_close(moe_experts(*args), moe.moe_experts_ref(*args), dtype, "moe_experts")
