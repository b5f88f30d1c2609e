"""Triton FP8 kernels vs their torch references (`fp8.*_ref`): the FP8 GEMV (`triton_gemv`, weight-only), the FP8
grouped GEMVs with the shared expert (`triton_moe_gemv`), the FP8 grouped GEMMs weight-only and W8A8
(`triton_moe`), the in-kernel e4m3 rounding against torch's cast. In the Triton interpreter on CPU (small shapes),
on the GPU at Nano's shapes and every tuned launch shape (marked gpu)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from service.engine.kernels import fp8
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear
from service.engine.kernels.moe import relu2
from service.engine.kernels.tiles import (
    EXPERT_GEMV_FP8_TILE_VARIANTS,
    GEMV_FP8_TILE_VARIANTS,
    QUANTIZE_TILE_VARIANTS,
    GemvTiles,
    MoeTiles,
)
from service.engine.kernels.triton_fp8 import f32_to_e4m3_bits, fp8_linear, quantize_fp8, quantize_fp8_tiled
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import Fp8ExpertScales, moe_experts_tiled
from service.engine.kernels.triton_moe_gemv import MAX_GEMV_PAIRS, fp8_moe_experts, moe_experts_gemv
from tests.kernels.triton_test_util import DEVICE, TOL, assert_close, gpu, needs_cuda, rel_err


def _fp8(w: torch.Tensor, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 weight, fp32 scale covering |w|: per tensor, or per slice of dim 0 when dims are given)."""
    amax = w.abs().amax(dim=dims) if dims else w.abs().max()
    scale = (amax / FP8_MAX).float()
    shaped = scale.reshape(-1, *([1] * (w.dim() - 1))) if dims else scale
    return (w / shaped).to(FP8_DTYPE).to(DEVICE), scale.to(DEVICE)


def _linear_inputs(M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w8, ws = _fp8(torch.randn(N, K, generator=g) * K**-0.5)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype)
    xs = (x.float().abs().max() / FP8_MAX).reshape(())
    return x, w8, ws, xs, b


FP8_GEMV_TILES = [
    GemvTiles(8, 128, 4),
    GemvTiles(4, 256, 4, False),
    GemvTiles(16, 64, 2, True, 3),
    GemvTiles(16, 64, 4, True, 2, mma=2),  # tensor cores, split-K
]


@pytest.mark.parametrize("M,dtype", [(1, torch.float32), (3, torch.float32), (1, torch.bfloat16), (4, torch.float16)])
@pytest.mark.parametrize("N,K", [(1, 1), (13, 100), (16, 384), (3, 1000)])
def test_fp8_gemv_equals_the_weight_only_reference(N, K, M, dtype):
    """The FP8 GEMV (e4m3 bytes decoded in registers, the scale in the epilogue) equals `fp8_linear_dequant_ref`
    up to summation order and output rounding: prefetch on/off, split-K with the last-arriver sum, bias or not."""
    x, w8, ws, xs, b = _linear_inputs(M, N, K, dtype, seed=N + K + M)
    ref = fp8.fp8_linear_dequant_ref(x, w8, ws, xs, b)
    for tiles in FP8_GEMV_TILES:
        if tiles.mma and dtype == torch.bfloat16 and DEVICE == "cpu":
            continue  # bf16 dots: GPU only (the interpreter's bf16 dot is off); the GPU test runs the mma variant
        assert_close(gemv(x, w8, b, tiles, weight_scale=ws.reshape(1)), ref, dtype, f"fp8 gemv {tiles}")
    no_bias = gemv(x, w8, None, weight_scale=ws.reshape(1))
    assert_close(no_bias, fp8.fp8_linear_dequant_ref(x, w8, ws, xs), dtype, "fp8 gemv default tiles, no bias")


def test_fp8_gemv_rejects_a_missing_scale():
    x, w8, ws, _, _ = _linear_inputs(1, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, w8)
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, w8, weight_scale=ws.reshape(1).double())


def test_fp8_linear_dispatch_by_shape():
    """`triton_fp8.fp8_linear`: a single row runs the FP8 GEMV (weight-only, bit-equal to `gemv`), more rows the
    W8A8 `_scaled_mm` path (bit-equal to `fp8.fp8_linear`); each matches its own reference."""
    x, w8, ws, xs, b = _linear_inputs(3, 48, 64, torch.bfloat16, seed=3)
    one = fp8_linear(x[:1].reshape(1, 1, 64), w8, ws, xs, b)
    assert one.shape == (1, 1, 48)
    assert torch.equal(one.view(1, 48), gemv(x[:1], w8, b, weight_scale=ws.reshape(1)))
    assert_close(one.view(1, 48), fp8.fp8_linear_dequant_ref(x[:1], w8, ws, xs, b), torch.bfloat16, "one row")
    many = fp8_linear(x, w8, ws, xs, b)
    assert torch.equal(many, fp8.fp8_linear(x, w8, ws, xs, b))  # the Triton quantization is torch's, bit for bit
    assert rel_err(many, fp8.fp8_linear_ref(x, w8, ws, xs, b)) < 1e-2


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, f32_to_e4m3_bits(v), mask=offs < n)


def test_e4m3_rounding_equals_torch_cast():
    """`f32_to_e4m3_bits` (integer ops, used in the W8A8 up-GEMM epilogue) equals torch's float8_e4m3fn cast bit for
    bit: every e4m3 value, the midpoints between neighbours (ties to even, mantissa carries into the exponent,
    subnormals, the smallest normal), and random values over the whole range."""
    codes = torch.arange(256, dtype=torch.uint8)
    vals = codes.view(FP8_DTYPE).float()
    finite = vals[vals.isfinite() & (vals.abs() <= FP8_MAX)].unique()
    pos = finite[finite >= 0]
    mids = (pos[1:] + pos[:-1]) / 2
    nudged = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    g = torch.Generator().manual_seed(0)
    rnd = torch.exp(torch.rand(4000, generator=g) * 22 - 16) * torch.sign(torch.randn(4000, generator=g))
    v = torch.cat([finite, nudged, -nudged, rnd.clamp(-FP8_MAX, FP8_MAX), torch.tensor([0.0, -0.0, 1e-30])])
    out = torch.empty(v.shape, dtype=torch.int32)
    vd, od = v.to(DEVICE), out.to(DEVICE)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](vd, od, v.numel(), BLOCK=1024)
    expect = v.to(FP8_DTYPE).view(torch.uint8).to(torch.int32)
    bad = (od.cpu() != expect).nonzero().flatten()
    assert bad.numel() == 0, list(zip(v[bad][:8].tolist(), od.cpu()[bad][:8].tolist(), expect[bad][:8].tolist()))


@pytest.mark.parametrize("tiles", [None, *QUANTIZE_TILE_VARIANTS[1:]], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_fp8_equals_torch(dtype, tiles):
    """The one-launch activation quantization equals `fp8.quantize_fp8` bit for bit, clamping included (values
    beyond +-448 * scale), on strided rows, a ragged last row block and a ragged last column block; every launch
    shape the benchmark times."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 1100, generator=g) * 3).to(DEVICE, dtype)[:, 30:]
    scale = torch.tensor([2.5 / FP8_MAX], device=DEVICE)
    q = quantize_fp8(x, scale) if tiles is None else quantize_fp8_tiled(x, scale, tiles)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert torch.equal(q.view(torch.uint8), fp8.quantize_fp8(x, scale).view(torch.uint8))


def fp8_moe_experts_gemv(x, up8, down8, up_s, down_s, ui, di, w, ids, tiles=None, **shared):
    """The grouped GEMVs in `fp8.fp8_moe_experts_ref`'s argument order (their FP8 scales packed)."""
    scales = Fp8ExpertScales(up_s, down_s, ui.reshape(1).float(), di.reshape(1).float())
    return moe_experts_gemv(x, up8, down8, w, ids, tiles, scales=scales, **shared)


def _moe(T, E, k, d, inter, S, dtype, seed):
    """FP8 expert stacks with per-expert scales (all different), an FP8 shared expert of S rows (None if S == 0),
    x, routing, the static input scales (x's up to ~4.5 sigma, the ReLU² output's larger)."""
    g = torch.Generator().manual_seed(seed)
    up8, up_s = _fp8(torch.randn(E, inter, d, generator=g) * d**-0.5 * torch.rand(E, 1, 1, generator=g), (1, 2))
    down8, down_s = _fp8(torch.randn(E, d, inter, generator=g) * inter**-0.5, (1, 2))
    x = torch.randn(T, d, generator=g).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    w = torch.rand(T, k, generator=g).to(DEVICE)
    in_s = (torch.tensor(4.5 / FP8_MAX), torch.tensor(12.0 / FP8_MAX))
    shared = {}
    if S:
        su, sus = _fp8(torch.randn(S, d, generator=g) * d**-0.5)
        sd, sds = _fp8(torch.randn(d, S, generator=g) * S**-0.5)
        shared = dict(
            shared_up=Fp8Linear(su, sus, in_s[0].to(DEVICE)), shared_down=Fp8Linear(sd, sds, in_s[1].to(DEVICE))
        )
    args = (x, up8, down8, up_s, down_s, in_s[0].to(DEVICE), in_s[1].to(DEVICE), w, ids)
    return args, shared


@pytest.mark.parametrize("T,S", [(1, 0), (1, 40), (2, 24), (3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: the GPU test (the interpreter's bf16 is off)
def test_fp8_moe_gemv_equals_the_weight_only_reference(T, S, dtype):
    """Grouped FP8 GEMVs: routed experts with per-expert scales and the shared expert (its own per-tensor scales)
    in the same two launches, vs `fp8_moe_experts_ref` weight-only; I (48) and S differ, K ragged vs block_k."""
    args, shared = _moe(T, 8, 4, 64, 48, S, dtype, seed=T + S)
    out = fp8_moe_experts_gemv(*args, **shared)
    assert_close(out, fp8.fp8_moe_experts_ref(*args, **shared), dtype, f"fp8 moe gemv T={T} S={S}")


def test_fp8_moe_gemv_rejects_too_many_pairs_and_half_a_shared_expert():
    args, shared = _moe(5, 8, 4, 32, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=str(MAX_GEMV_PAIRS)):
        fp8_moe_experts_gemv(*args)
    one, shared = _moe(1, 8, 4, 32, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="both"):
        fp8_moe_experts_gemv(*one, shared_up=shared["shared_up"])


TILED_CASES = [
    # (T, dtype, w8a8, tiles): weight-only runs x's dtype dots (no bf16 dot in the interpreter: fp32/fp16 on CPU)
    (1, torch.float32, False, MoeTiles(16, 32, 32, 4, 1)),
    (9, torch.float16, False, MoeTiles(16, 32, 32, 4, 1)),
    (24, torch.float32, False, MoeTiles(32, 16, 32, 4, 1)),
    (1, torch.bfloat16, True, MoeTiles(16, 32, 32, 4, 1)),
    (2, torch.float32, True, None),  # the default FP8 decode tiles (K 256 per step: d 48 is one masked step)
    (9, torch.float32, True, MoeTiles(16, 32, 32, 4, 1)),
    (24, torch.bfloat16, True, MoeTiles(32, 16, 32, 4, 1)),
]


@pytest.mark.parametrize("T,dtype,w8a8,tiles", TILED_CASES, ids=str)
def test_fp8_grouped_gemms_equal_the_reference(T, dtype, w8a8, tiles):
    """The FP8 modes of triton_moe's grouped GEMMs vs `fp8_moe_experts_ref` with quantize_activations = w8a8 (W8A8:
    x quantized by the launcher, the ReLU² output quantized in the up epilogue by `f32_to_e4m3_bits`, e4m3 dots,
    the scales applied in the epilogues); K ragged against block_k, several blocks per expert."""
    if dtype == torch.bfloat16 and not w8a8 and DEVICE == "cpu":
        pytest.skip("bf16 dots: GPU only")
    args, _ = _moe(T, 8, 3, 48, 40, 0, dtype, seed=T)
    x, up8, down8, up_s, down_s, ui, di, w, ids = args
    scales = Fp8ExpertScales(up_s, down_s, ui.reshape(1).float(), di.reshape(1).float())
    out = moe_experts_tiled(x, up8, down8, w, ids, tiles, scales, w8a8)
    ref = fp8.fp8_moe_experts_ref(*args, w8a8)
    # W8A8 in bf16: the kernel's and the reference's ReLU² outputs round to bf16 after different fp32 summation
    # orders, so a few of the 40 h values per row land on the neighbouring e4m3 value (one e4m3 step: 6-12 %)
    tol = TOL[dtype] if not w8a8 else {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    assert rel_err(out, ref) <= tol, (rel_err(out, ref), tol)
    if w8a8 and dtype == torch.float32:  # the activation quantization is real: weight-only is further away
        assert rel_err(out, fp8.fp8_moe_experts_ref(*args)) > 3 * tol


@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_moe_by_size_routes_and_adds_the_shared_expert(w8a8):
    """Above MAX_GEMV_PAIRS: the grouped GEMMs (W8A8 or weight-only) plus the FP8 shared expert as two linears
    (W8A8 `_scaled_mm`), vs the reference with the same activation quantization; below: the GEMV path."""
    args, shared = _moe(6, 8, 3, 32, 32, 16, torch.float32, seed=8)
    out = fp8_moe_experts(*args, **shared, w8a8=w8a8)
    routed = fp8.fp8_moe_experts_ref(*args, w8a8)
    u, d = shared["shared_up"], shared["shared_down"]
    h = relu2(fp8.fp8_linear_ref(args[0], u.weight, u.weight_scale, u.input_scale))  # the shared linears: W8A8
    assert_close(out, routed + fp8.fp8_linear_ref(h, d.weight, d.weight_scale, d.input_scale), torch.float32, "")
    one, shared1 = _moe(1, 8, 3, 32, 32, 16, torch.float32, seed=1)
    assert torch.equal(fp8_moe_experts(*one, **shared1), fp8_moe_experts_gemv(*one, **shared1))


# ---- GPU: Nano shapes, every tuned launch shape ----


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", sorted(GEMV_FP8_TILE_VARIANTS), ids=str)
def test_fp8_gemv_gpu_nano_shapes_every_variant(shape):
    N, K = shape
    x, w8, ws, xs, b = _linear_inputs(1, N, K, torch.bfloat16, seed=N)
    ref = fp8.fp8_linear_dequant_ref(x, w8, ws, xs)
    for tiles in GEMV_FP8_TILE_VARIANTS[shape]:
        assert_close(gemv(x, w8, None, tiles, weight_scale=ws.reshape(1)), ref, torch.bfloat16, f"{shape} {tiles}")


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 2])
def test_fp8_moe_gemv_gpu_nano(T):
    """Nano: E 128, top-6, d 2688, I 1856, shared 3712; every (up, down) launch-shape pair of the FP8 table."""
    args, shared = _moe(T, 128, 6, 2688, 1856, 3712, torch.bfloat16, seed=T)
    ref = fp8.fp8_moe_experts_ref(*args, **shared)
    for up, down in EXPERT_GEMV_FP8_TILE_VARIANTS:
        out = fp8_moe_experts_gemv(*args, up, down_tiles=down, **shared)
        assert_close(out, ref, torch.bfloat16, f"nano fp8 moe gemv T={T} {up} / {down}")


@gpu
@needs_cuda
@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("T", [3, 64, 256, 512, 1024, 2048])
def test_fp8_grouped_gemms_gpu_nano(T, w8a8):
    """Every default tile of both modes: decode (<= 16 pairs per expert), <= 32, <= 48, prefill (T = 2048: 96)."""
    args, _ = _moe(T, 128, 6, 2688, 1856, 0, torch.bfloat16, seed=T)
    x, up8, down8, up_s, down_s, ui, di, w, ids = args
    out = moe_experts_tiled(
        x, up8, down8, w, ids, None, Fp8ExpertScales(up_s, down_s, ui.reshape(1), di.reshape(1)), w8a8
    )
    assert rel_err(out, fp8.fp8_moe_experts_ref(*args, w8a8)) < 2e-2


def test_experts_reject_a_shared_expert_of_the_other_kind():
    """FP8 experts take the shared expert as `Fp8Linear`s, experts in x's dtype as tensors: a mix is a clear error."""
    args, shared = _moe(1, 8, 4, 32, 16, 16, torch.float32, seed=0)
    x, up8, down8, _, _, _, _, w, ids = args
    plain = dict(shared_up=shared["shared_up"].weight.float(), shared_down=shared["shared_down"].weight.float())
    with pytest.raises(ValueError, match="Fp8Linear"):
        fp8_moe_experts_gemv(*args, **plain)
    with pytest.raises(ValueError, match="tensors"):
        moe_experts_gemv(x, up8.float(), down8.float(), w, ids, **shared)
