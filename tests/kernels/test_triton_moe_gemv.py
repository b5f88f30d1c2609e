"""Grouped-GEMV MoE experts (batch-1/2 decode) vs the torch reference and the tiled Triton path; the shared expert
folded into them (and into the reference, vs a plain-torch oracle)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from service.engine.kernels import moe
from service.engine.kernels.tiles import EXPERT_GEMV_TILE_VARIANTS, ExpertGemvTiles
from service.engine.kernels.triton_moe import moe_experts
from service.engine.kernels.triton_moe_gemv import (
    MAX_GEMV_PAIRS,
    moe_experts_by_size,
    moe_experts_gemv,
    moe_experts_tiled_shared,
)
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, moe_inputs, needs_cuda


def _shared_weights(S: int, d: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """The shared expert's keyword args: shared_up [S, d], shared_down [d, S] (scaled like `moe_inputs`' experts)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        shared_up=(torch.randn(S, d, generator=g) * d**-0.5).to(DEVICE, dtype),
        shared_down=(torch.randn(d, S, generator=g) * S**-0.5).to(DEVICE, dtype),
    )


@pytest.mark.parametrize(
    "T,k,d,inter,dtype",
    [
        (1, 6, 40, 24, torch.float32),
        (2, 3, 33, 70, torch.float32),
        (2, 3, 33, 70, torch.float16),
        (1, 1, 516, 9, torch.float32),
        (1, 1, 516, 9, torch.float16),
        (2, 8, 16, 34, torch.float32),
    ],
)
def test_moe_experts_gemv_matches_ref(T, k, d, inter, dtype):
    """Rows and K uneven in the tiles (4 and 8 rows, K steps of 64 and 512); K of several steps with the prefetch
    (d 516: 9 steps of 64 and 2 of 512, I 70: 2); T * k at the pair limit (2 x 8); fp16 loads and stores on two."""
    args = moe_inputs(T, E=12, k=k, d=d, inter=inter, dtype=dtype, seed=T * 100 + d)
    ref, tiled = moe.moe_experts_ref(*args), moe_experts(*args)
    for tiles in (None, ExpertGemvTiles(8, 64, 4), ExpertGemvTiles(4, 64, 2)):
        out = moe_experts_gemv(*args, tiles)
        assert out.dtype == dtype and out.shape == (T, d)
        assert_close(out, ref, dtype, f"moe_experts_gemv {tiles}")
        assert_close(out, tiled, dtype, "moe_experts_gemv vs tiled")


def test_moe_experts_gemv_repeated_expert_and_limits():
    """Both slots of a token on one expert (weights summed), T = 0, and a batch above the pair limit."""
    x, up, down, _, _ = moe_inputs(2, E=4, k=2, d=24, inter=20, dtype=torch.float32, seed=3)
    ids = torch.tensor([[1, 1], [3, 0]], device=DEVICE)
    w = torch.tensor([[0.25, 0.5], [1.0, 2.0]], device=DEVICE)
    assert_close(
        moe_experts_gemv(x, up, down, w, ids),
        moe.moe_experts_ref(x, up, down, w, ids),
        torch.float32,
        "repeated expert",
    )
    assert moe_experts_gemv(x[:0], up, down, w[:0], ids[:0]).shape == (0, 24)
    many = MAX_GEMV_PAIRS // 2 + 1
    with pytest.raises(ValueError, match="pairs"):
        moe_experts_gemv(x[:1].expand(many, 24), up, down, w[:1].expand(many, 2), ids[:1].expand(many, 2))


# ---------------- the shared expert ----------------
@pytest.mark.parametrize(
    "T,k,d,inter,S,dtype",
    [
        (1, 6, 40, 24, 37, torch.float32),
        (2, 3, 33, 70, 13, torch.float32),
        (2, 3, 33, 70, 13, torch.float16),
        (1, 1, 516, 9, 30, torch.float32),
        (1, 1, 516, 9, 30, torch.float16),
        (1, 6, 64, 64, 128, torch.float32),
    ],
)
def test_moe_experts_gemv_shared_matches_ref(T, k, d, inter, S, dtype):
    """S above and below I, S not a multiple of BLOCK_N, d_in and I / S each uneven in BLOCK_K, and all even in
    BLOCK_K 64 (d 64, I 64, S 128: both passes without masks); fp16 loads and stores on two."""
    args = moe_inputs(T, E=12, k=k, d=d, inter=inter, dtype=dtype, seed=T * 100 + d)
    shared = _shared_weights(S, d, dtype, seed=S)
    ref = moe.moe_experts_ref(*args, **shared)
    for tiles in (None, ExpertGemvTiles(8, 64, 4), ExpertGemvTiles(4, 64, 2)):
        out = moe_experts_gemv(*args, tiles, **shared)
        assert out.dtype == dtype and out.shape == (T, d)
        assert_close(out, ref, dtype, f"moe_experts_gemv + shared {tiles}")
    assert_close(moe_experts_tiled_shared(*args, **shared), ref, dtype, "tiled + shared")


@pytest.mark.parametrize(
    "up_tiles,down_tiles",
    [
        (ExpertGemvTiles(4, 32, 2, depth=1), None),
        (ExpertGemvTiles(4, 32, 2, depth=3), ExpertGemvTiles(8, 16, 4, depth=4)),
        (ExpertGemvTiles(8, 32, 4, depth=1, stages=3), ExpertGemvTiles(4, 64, 2, depth=1, stages=2)),
        (ExpertGemvTiles(2, 128, 1, depth=4), ExpertGemvTiles(2, 16, 1, depth=3)),
    ],
    ids=str,
)
def test_moe_experts_gemv_tile_knobs(up_tiles, down_tiles):
    """The tuning knobs (register prefetch depth 1-4, Triton's loop pipeline) and separate down-pass tiles: same
    result as the reference with the shared expert; d_in and I / S even and uneven in BLOCK_K, K of one step."""
    for T, k, d, inter, S in ((2, 3, 40, 24, 37), (1, 2, 64, 16, 128)):
        args = moe_inputs(T, E=6, k=k, d=d, inter=inter, dtype=torch.float32, seed=d + S)
        shared = _shared_weights(S, d, torch.float32, seed=S)
        out = moe_experts_gemv(*args, up_tiles, down_tiles=down_tiles, **shared)
        assert_close(out, moe.moe_experts_ref(*args, **shared), torch.float32, f"{up_tiles} / {down_tiles}")


@pytest.mark.parametrize("chunks,S", [(2, 48), (3, 37)])
def test_moe_experts_gemv_shared_expert_in_k_chunks(chunks, S):
    """The down pass with the shared expert's K cut into chunks (each its own unit, summed with the routed slots):
    the reference's result, K chunks even (2 x 24, each of 2 steps of 16 with the last masked) and ragged
    (37 = 13 + 13 + 11); without a shared expert the knob changes nothing."""
    args = moe_inputs(2, E=8, k=3, d=40, inter=24, dtype=torch.float32, seed=S)
    shared = _shared_weights(S, 40, torch.float32, seed=chunks)
    down = ExpertGemvTiles(4, 16, 2, shared_chunks=chunks)
    out = moe_experts_gemv(*args, ExpertGemvTiles(4, 16, 2), down_tiles=down, **shared)
    assert_close(out, moe.moe_experts_ref(*args, **shared), torch.float32, f"shared expert in {chunks} K chunks")
    routed = moe_experts_gemv(*args, ExpertGemvTiles(4, 16, 2), down_tiles=down)
    assert torch.equal(routed, moe_experts_gemv(*args, ExpertGemvTiles(4, 16, 2)))


def test_expert_gemv_tiles_rejects_bad_knobs():
    for kw in (dict(depth=0), dict(depth=5), dict(stages=0), dict(stages=3), dict(shared_chunks=0)):
        with pytest.raises(ValueError):
            ExpertGemvTiles(**kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_moe_experts_ref_shared_equals_routed_plus_shared_mlp(dtype):
    """Oracle: the reference's shared expert is the routed reference plus a plain-torch ReLU² MLP (fp32)."""
    args = moe_inputs(3, E=8, k=2, d=48, inter=40, dtype=dtype, seed=7)
    shared = _shared_weights(56, 48, dtype, seed=8)
    x, up_s, down_s = args[0].float(), shared["shared_up"].float(), shared["shared_down"].float()
    oracle = moe.moe_experts_ref(*args).float() + F.linear(F.linear(x, up_s).relu().square(), down_s)
    out = moe.moe_experts_ref(*args, **shared)
    assert out.dtype == dtype
    assert_close(out, oracle, dtype, "moe_experts_ref + shared")


@pytest.mark.parametrize("T", [1, 2, 3, 20])
def test_moe_experts_by_size_shared(T):
    """Both sides of the GEMV limit (k = 6: T <= 2 grouped GEMVs, T >= 3 tiled GEMMs + the shared MLP)."""
    args = moe_inputs(T, E=16, k=6, d=40, inter=24, dtype=torch.float16, seed=T)
    shared = _shared_weights(36, 40, torch.float16, seed=T + 1)
    assert_close(
        moe_experts_by_size(*args, **shared),
        moe.moe_experts_ref(*args, **shared),
        torch.float16,
        f"moe_experts_by_size + shared T={T}",
    )
    assert_close(moe_experts_by_size(*args), moe.moe_experts_ref(*args), torch.float16, f"by size T={T}")


@pytest.mark.parametrize("op", [moe.moe_experts_ref, moe_experts_gemv, moe_experts_by_size], ids=lambda f: f.__name__)
def test_moe_experts_shared_args_checked(op):
    args = moe_inputs(1, E=4, k=2, d=24, inter=20, dtype=torch.float32, seed=3)
    shared = _shared_weights(12, 24, torch.float32, seed=4)
    for name in ("shared_up", "shared_down"):
        with pytest.raises(ValueError, match="pass both shared_up .* and shared_down"):
            op(*args, **{name: shared[name]})
    with pytest.raises(ValueError, match="shared_up must be"):
        op(*args, shared_up=shared["shared_up"], shared_down=shared["shared_down"].t())
    if op is not moe.moe_experts_ref:
        with pytest.raises(ValueError, match="shared_up must have dtype"):
            op(*args, shared_up=shared["shared_up"].half(), shared_down=shared["shared_down"])
        with pytest.raises(ValueError, match="contiguous"):
            op(*args, shared_up=shared["shared_up"], shared_down=shared["shared_down"].t().contiguous().t())


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", EXPERT_GEMV_TILE_VARIANTS, ids=str)
@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_experts_gemv_gpu_nano(T, tiles, with_shared):
    """Nemotron-3-Nano: 128 experts, top-6, d 2688, I 1856, bf16; with_shared: the shared expert S 3712 too."""
    args = moe_inputs(T, E=128, k=6, d=2688, inter=1856, dtype=torch.bfloat16, seed=T)
    shared = _shared_weights(3712, 2688, torch.bfloat16, seed=T + 10) if with_shared else {}
    ref = moe.moe_experts_ref(*args, **shared)
    assert_close(moe_experts_gemv(*args, tiles, **shared), ref, torch.bfloat16, f"gemv {tiles} shared={with_shared}")
    chunked = dataclasses.replace(tiles, shared_chunks=2)
    out = moe_experts_gemv(*args, tiles, down_tiles=chunked, **shared)
    assert_close(out, ref, torch.bfloat16, f"gemv {tiles} shared={with_shared}, shared expert in 2 K chunks")
