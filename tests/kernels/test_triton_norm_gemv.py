"""Norm fused into the single-row GEMV's prologue (triton_norm_gemv) vs the unfused kernels (triton_norm +
triton_gemv.gemv with the same tiles: bit-equal under the interpreter) and vs the torch references: residual add +
RMSNorm + linear, gated group RMSNorm + linear; split-K with persistent counters, K not a multiple of BLOCK_K,
chunks inside a group / spanning groups / straddling a group edge; the bundle ops' dispatch by shape."""

from __future__ import annotations

import collections

import pytest
import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.config import ModelConfig
from service.engine.kernels import norm, triton_gemv, triton_norm, triton_norm_gemv
from service.engine.kernels.tiles import GEMV_TILE_VARIANTS, GemvTiles, default_gemv_tiles
from service.engine.kernels.triton_backend import triton_kernels
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_norm_gemv import (
    add_rms_norm_gemv,
    add_rms_norm_linear,
    gated_norm_gemv,
    gated_norm_linear,
)
from service.engine.runner.model_runner import build_model
from service.testing.tiny import make_tiny_model
from tests.kernels.triton_test_util import DEVICE, assert_close, assert_pdl_chain_bit_equal, gpu, needs_cuda
from tests.outputs import assert_same_outputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
INTERPRETED = DEVICE == "cpu"  # bit-equality with the unfused kernels holds where the reductions match
# (N, K, tiles): split-K over a K that BLOCK_K does not divide, no prefetch, K < BLOCK_K, default tiles with split-K
# (8 x 256 x 4 for both default cases: ragged rows with K of 4 slices; whole row blocks with 3 slices past K),
# rows longer than the prologue's 512-element chunk (its chunk sums added pairwise)
ADD_CASES = [
    (50, 300, GemvTiles(8, 32, 4, True, 3)),
    (37, 256, GemvTiles(4, 64, 4, False)),
    (64, 100, GemvTiles(16, 32, 2, True, 2)),
    (34, 1000, None),
    (72, 64, None),
    (33, 17, GemvTiles(2, 256, 1, True, 4)),
    (20, 2688, GemvTiles(8, 256, 4)),
]  # last: Nano's K
# (N, Di, group, tiles): chunks inside a group, spanning 2 groups, straddling group edges, split-K + ragged K,
# the tiny model's out_proj, one non-power-of-two group, groups > the prologue's 512-element chunk
GATED_CASES = [
    (50, 256, 128, GemvTiles(8, 32, 4)),
    (40, 96, 16, GemvTiles(4, 32, 4, False)),
    (40, 96, 48, GemvTiles(8, 64, 4)),
    (64, 300, 100, GemvTiles(8, 64, 4, True, 3)),
    (64, 64, 32, None),
    (30, 80, 80, None),
    (16, 3072, 1536, GemvTiles(8, 512, 4, True, 2)),
]


def _randn(*shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _weights(N, K, dtype, g, bias):
    w = _randn(N, K, g=g, scale=K**-0.5, dtype=dtype)
    return w, _randn(N, g=g, dtype=dtype) if bias else None


def _assert_unfused(out: torch.Tensor, unfused: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Bit-equal under the interpreter; on a GPU the rms reductions' order differs (other warps): tolerance."""
    if INTERPRETED:
        assert torch.equal(out, unfused), f"{what}: differs from the unfused kernels"
    else:
        assert_close(out, unfused, dtype, f"{what} vs unfused")


def _check_add(N, K, tiles, dtype, seed, bias, counters=None):
    g = torch.Generator().manual_seed(seed)
    x, res = _randn(1, K, g=g, dtype=dtype), _randn(1, K, g=g, scale=3.0, dtype=dtype)
    nw = _randn(K, g=g, dtype=dtype)
    w, b = _weights(N, K, dtype, g, bias)
    before = (x.clone(), res.clone())
    y, new_res = add_rms_norm_gemv(x, res, nw, EPS, w, b, tiles, counters)
    assert y.shape == (1, N) and new_res.shape == (1, K) and y.dtype == new_res.dtype == dtype
    normed, res_unfused = triton_norm.add_rms_norm(x, res, nw, EPS)
    assert torch.equal(new_res, res_unfused)
    _assert_unfused(y, gemv(normed, w, b, tiles), dtype, f"add_rms_norm_gemv N={N} K={K} {tiles}")
    y_ref, res_ref = norm.add_rms_norm_linear_ref(
        x.float(), res.float(), nw.float(), EPS, w.float(), None if b is None else b.float()
    )
    assert_close(y, y_ref, dtype, "add_rms_norm_gemv vs ref")
    assert_close(new_res, res_ref, dtype, "new_residual vs ref")
    assert torch.equal(x, before[0]) and torch.equal(res, before[1])  # out of place
    return y, new_res


def _check_gated(N, Di, group, tiles, dtype, seed, bias, y_dtype=None, counters=None):
    """y (the SSM output, fp32 in the decode step unless y_dtype) and z (a strided split of a wider row)."""
    g = torch.Generator().manual_seed(seed)
    y = _randn(1, Di, g=g, dtype=y_dtype or dtype)
    z = _randn(1, Di + 7, g=g, dtype=dtype)[:, 3 : 3 + Di]
    nw = _randn(Di, g=g, dtype=dtype)
    w, b = _weights(N, Di, dtype, g, bias)
    out = gated_norm_gemv(y, z, nw, group, EPS, w, b, tiles, counters)
    assert out.shape == (1, N) and out.dtype == dtype
    normed = triton_norm.gated_group_rms_norm(y, z, nw, group, EPS, dtype)
    _assert_unfused(out, gemv(normed, w, b, tiles), dtype, f"gated_norm_gemv N={N} Di={Di} g={group} {tiles}")
    ref = norm.gated_norm_linear_ref(
        y.float(), z.float(), nw.float(), group, EPS, w.float(), None if b is None else b.float()
    )
    assert_close(out, ref, dtype, "gated_norm_gemv vs ref")
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K,tiles", ADD_CASES, ids=str)
def test_add_rms_norm_gemv_matches_unfused_and_ref(N, K, tiles, dtype):
    for bias in (False, True):
        _check_add(N, K, tiles, dtype, seed=N + K, bias=bias)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,Di,group,tiles", GATED_CASES, ids=str)
def test_gated_norm_gemv_matches_unfused_and_ref(N, Di, group, tiles, dtype):
    for bias in (False, True):
        _check_gated(N, Di, group, tiles, dtype, seed=N + Di + group, bias=bias)
    _check_gated(N, Di, group, tiles, dtype, seed=1, bias=False, y_dtype=torch.float32)  # as in the decode step


def test_default_tiles_split_k_with_persistent_counters():
    """Default tiles of an untuned shape split K; one persistent buffer serves repeated fused launches and is left
    zeroed, results equal to the fresh-counter launches."""
    assert default_gemv_tiles(130, 1000).split_k > 1
    t = GemvTiles(8, 64, 4, True, 3)
    counters = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    fresh_add = _check_add(50, 300, t, torch.float32, seed=3, bias=True)
    fresh_gated = _check_gated(64, 300, 100, t, torch.float32, seed=4, bias=True)
    for _ in range(2):
        y, new_res = _check_add(50, 300, t, torch.float32, seed=3, bias=True, counters=counters)
        assert not counters.any() and torch.equal(y, fresh_add[0]) and torch.equal(new_res, fresh_add[1])
        out = _check_gated(64, 300, 100, t, torch.float32, seed=4, bias=True, counters=counters)
        assert not counters.any() and torch.equal(out, fresh_gated)


def test_bundle_ops_dispatch_by_shape():
    """One row: the fused kernel (bit-equal to it); several rows: the unfused kernels (bit-equal to them)."""
    g = torch.Generator().manual_seed(7)
    K, Di, N = 64, 96, 40
    x, res, nw = _randn(3, K, g=g), _randn(3, K, g=g), _randn(K, g=g)
    w, b = _weights(N, K, torch.float32, g, bias=True)
    y1, r1 = add_rms_norm_linear(x[:1], res[:1], nw, EPS, w, b)
    fused = add_rms_norm_gemv(x[:1], res[:1], nw, EPS, w, b)
    assert torch.equal(y1, fused[0]) and torch.equal(r1, fused[1])
    y3, r3 = add_rms_norm_linear(x, res, nw, EPS, w, b)
    normed, r_unfused = triton_norm.add_rms_norm(x, res, nw, EPS)
    assert torch.equal(y3, triton_gemv.linear(normed, w, b)) and torch.equal(r3, r_unfused)
    ys, zs, nwg = _randn(3, Di, g=g), _randn(3, Di, g=g), _randn(Di, g=g)
    wg, _ = _weights(N, Di, torch.float32, g, bias=False)
    assert torch.equal(
        gated_norm_linear(ys[:1], zs[:1], nwg, 32, EPS, wg), gated_norm_gemv(ys[:1], zs[:1], nwg, 32, EPS, wg)
    )
    unfused = triton_gemv.linear(triton_norm.gated_group_rms_norm(ys, zs, nwg, 32, EPS, wg.dtype), wg)
    assert torch.equal(gated_norm_linear(ys, zs, nwg, 32, EPS, wg), unfused)


def test_rejects_bad_arguments():
    x, w, nw = torch.randn(2, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE), torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="one non-empty row"):
        add_rms_norm_gemv(x, x, nw, EPS, w)
    with pytest.raises(ValueError, match="dtype"):
        add_rms_norm_gemv(x[:1].half(), x[:1].half(), nw, EPS, w)
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_gemv(x[:1], x[:1], nw[:16], EPS, w)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_gemv(x[:1], x[:1], nw, EPS, w[:, :16])
    with pytest.raises(ValueError, match="group_size"):
        gated_norm_gemv(x[:1], x[:1], nw, 12, EPS, w)
    with pytest.raises(ValueError, match="z"):
        gated_norm_gemv(x[:1], x[:1, :16], nw, 16, EPS, w)


# Nano-30B-A3B: in_proj [10304, 2688] after the layer's add + norm; out_proj [2688, 4096] after the gated norm
# (8 groups of 512); every GEMV tile variant of those shapes, bf16
NANO_IN_PROJ, NANO_OUT_PROJ = (10304, 2688), (2688, 4096)


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", GEMV_TILE_VARIANTS[NANO_IN_PROJ], ids=str)
def test_add_rms_norm_gemv_gpu_nano(tiles):
    _check_add(*NANO_IN_PROJ, tiles, torch.bfloat16, seed=11, bias=False)


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", GEMV_TILE_VARIANTS[NANO_OUT_PROJ], ids=str)
def test_gated_norm_gemv_gpu_nano(tiles):
    _check_gated(*NANO_OUT_PROJ, 512, tiles, torch.bfloat16, seed=12, bias=False, y_dtype=torch.float32)
    _check_gated(*NANO_OUT_PROJ, 512, tiles, torch.bfloat16, seed=13, bias=True)


@gpu
@needs_cuda
def test_fused_gpu_pdl_chain_in_graph():
    """A chain of dependent fused ops (each reads the previous output and residual, ~14 MB weights each: no link
    fits in L2) captured in a CUDA graph with PDL and without: bit-equal on every replay with new inputs and equal
    to the eager chain. Reading x / the residual before `pdl_wait`, or writing new_residual before it, would race."""
    g = torch.Generator(device=DEVICE).manual_seed(5)
    d = 2688
    ws = [(torch.randn(d, d, generator=g, device=DEVICE) * d**-0.5).to(torch.bfloat16) for _ in range(12)]
    nw = (1 + 0.1 * torch.randn(d, generator=g, device=DEVICE)).to(torch.bfloat16)
    x = torch.randn(1, d, generator=g, device=DEVICE).to(torch.bfloat16)
    res = torch.randn(1, d, generator=g, device=DEVICE).to(torch.bfloat16)

    def chain(pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        y, r = x, res
        for i in range(0, len(ws), 2):
            y, r = add_rms_norm_gemv(y, r, nw, EPS, ws[i], pdl=pdl)
            y = gated_norm_gemv(y, r, nw, 336, EPS, ws[i + 1], pdl=pdl)
        return y, r

    def refill() -> None:
        x.copy_(torch.randn(1, d, generator=g, device=DEVICE).to(torch.bfloat16))
        res.copy_(torch.randn(1, d, generator=g, device=DEVICE).to(torch.bfloat16))

    assert_pdl_chain_bit_equal(chain, refill)


# ---------------- the engine (tiny checkpoint, triton bundle): batch-1 decode with the fusion on and off ----------


def _generate(path: str, fused: bool, graphs: bool = False) -> list:
    """Greedy runs, one request at a time (every decode step is batch 1), eager unless graphs."""
    cfg = EngineConfig(
        model_path=path,
        device=DEVICE,
        dtype="float32",
        mamba_cache_strategy="off",
        page_size=4,
        max_num_seqs=1,
        max_num_batched_tokens=32,
        kernel_backend="triton",
        cuda_graphs=graphs,
    )
    model = build_model(cfg, ModelConfig.from_model_path(path), torch.float32, torch.device(DEVICE))
    model.kernels = triton_kernels(fuse_norm_linear=fused)  # before the engine captures its graphs
    engine = Engine(cfg, model=model)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    return engine.generate([[5, 9, 200, 17, 3, 44, 8] * 2, [11, 12, 13]], params)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_norm_gemv")), seed=3)


@pytest.mark.slow  # ~160 s in the interpreter for a fusion that is off by default; the kernel tests above run by default
def test_engine_batch1_fusion_leaves_tokens_and_logprobs_unchanged(tiny_dir, monkeypatch):
    """The tiny model ("M*MEM-M*E": mamba layers 2, 4, 6 take the fused add + norm + in_proj, all 4 the fused
    gated norm + out_proj) at batch 1: the fused kernels run in every decode step, and tokens and logprobs equal
    those with the fusion switched off (bit-equal under the interpreter: the kernels are)."""
    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    for name in ("add_rms_norm_gemv", "gated_norm_gemv"):
        monkeypatch.setattr(triton_norm_gemv, name, counted(name, getattr(triton_norm_gemv, name)))
    fused = _generate(tiny_dir, fused=True)
    decode_steps = sum(len(o.token_ids) - 1 for o in fused)
    assert calls["add_rms_norm_gemv"] == 3 * decode_steps and calls["gated_norm_gemv"] == 4 * decode_steps
    calls.clear()
    off = _generate(tiny_dir, fused=False)
    assert not calls
    assert_same_outputs(fused, off, 0.0 if INTERPRETED else 1e-4)


@gpu
@needs_cuda
def test_engine_batch1_fused_graphs_gpu(tiny_dir):
    """CUDA graphs (batch-1 bucket, layer segments: a mamba layer that starts a segment takes the plain path)
    with the fusion vs eager without it: same greedy tokens, logprobs within 1e-4 (fp32)."""
    assert_same_outputs(_generate(tiny_dir, fused=True, graphs=True), _generate(tiny_dir, fused=False), 1e-4)
