"""The `fp8` group of benchmarks/kernels.py: the Triton FP8 kernels at Nano-30B-A3B shapes.

- Batch-1 linears: `triton_fp8.fp8_linear` (the FP8 GEMV, weight-only) against `fp8.fp8_linear` (the torch
  quantization + `_scaled_mm` path) on the Mamba / shared-expert projections, then every FP8 GEMV launch shape
  (`GEMV_FP8_TILE_VARIANTS`, first = default).
- Batch-1 MoE layer (routed top-6 + the shared expert): the FP8 grouped GEMVs over launch-shape variants.
- Grouped GEMMs at T = 64 .. 8192: BF16, FP8 weight-only and FP8 W8A8 side by side (which mode the bundle uses above
  16 pairs is `triton_moe_gemv.TILED_FP8_W8A8`), then W8A8 tile variants at T = 256 and 8192.
- Activation quantization (one Triton launch vs torch's ops) and the multi-row FP8 linear built on it.
Each row's rel err compares with the torch reference of the same math."""

from __future__ import annotations

import functools

import torch

from benchmarks.kernels import BF16, DEV, HIDDEN, INTER, TOPK, Case, E
from service.engine.kernels import fp8, moe
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear
from service.engine.kernels.tiles import (
    EXPERT_GEMV_FP8_TILES,
    GEMV_FP8_TILE_VARIANTS,
    QUANTIZE_TILE_VARIANTS,
    ExpertGemvTiles,
    MoeTiles,
)
from service.engine.kernels.triton_fp8 import fp8_linear, quantize_fp8, quantize_fp8_tiled
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import Fp8ExpertScales, moe_experts_tiled
from service.engine.kernels.triton_moe_gemv import moe_experts_gemv

SHARED = 3712  # Nano's shared-expert intermediate size
EXPERT_GEMV_FP8_VARIANTS = (
    EXPERT_GEMV_FP8_TILES,
    ExpertGemvTiles(),
    ExpertGemvTiles(8, 512, 4),
    ExpertGemvTiles(8, 1024, 8),
    ExpertGemvTiles(2, 1024, 4),
    ExpertGemvTiles(4, 1024, 4, 3),
    ExpertGemvTiles(4, 512, 4, 1, 3),
    ExpertGemvTiles(4, 1024, 4),
    ExpertGemvTiles(32, 128, 4, mma=4),
    ExpertGemvTiles(64, 256, 4, mma=3),
    ExpertGemvTiles(128, 128, 8, mma=3),
)
# 24 and 48 pairs per expert (Nano at T=512 and 1024): large decode batches
W8A8_LARGE_DECODE_TILES = (
    MoeTiles(32, 64, 256, 4, 3),
    MoeTiles(32, 128, 256, 4, 3),
    MoeTiles(32, 128, 128, 4, 4),
    MoeTiles(64, 64, 256, 4, 3),
    MoeTiles(64, 128, 64, 4, 3),
    MoeTiles(64, 128, 128, 4, 3),
    MoeTiles(64, 128, 128, 4, 4),
    MoeTiles(64, 128, 256, 4, 3),
    MoeTiles(64, 256, 128, 8, 3),
    MoeTiles(128, 128, 128, 8, 3),
)
W8A8_TILE_VARIANTS = {
    256: (
        MoeTiles(16, 64, 256, 4, 4),
        MoeTiles(16, 64, 128, 4, 4),
        MoeTiles(16, 64, 256, 4, 3),
        MoeTiles(16, 128, 256, 4, 3),
        MoeTiles(32, 64, 256, 4, 3),
        MoeTiles(64, 64, 256, 4, 3),
        MoeTiles(16, 128, 128, 4, 4),
        MoeTiles(32, 128, 128, 4, 4),
        MoeTiles(64, 128, 128, 4, 4),
        MoeTiles(16, 64, 128, 4, 5),
    ),
    512: W8A8_LARGE_DECODE_TILES,
    1024: W8A8_LARGE_DECODE_TILES,
    8192: (
        MoeTiles(128, 128, 128, 4, 3),
        MoeTiles(128, 256, 128, 8, 3),
        MoeTiles(128, 128, 128, 8, 4),
        MoeTiles(128, 256, 64, 8, 4),
        MoeTiles(64, 256, 128, 4, 3),
        MoeTiles(128, 128, 256, 8, 3),
        MoeTiles(128, 256, 128, 8, 4),
        MoeTiles(64, 128, 128, 4, 4),
        MoeTiles(256, 128, 128, 8, 3),
    ),
}


def _fp8(w: torch.Tensor, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=dims) if dims else w.abs().max()
    scale = (amax / FP8_MAX).float()
    shaped = scale.reshape(-1, *([1] * (w.dim() - 1))) if dims else scale
    return (w / shaped).to(FP8_DTYPE), scale


def _linear_make(T: int, N: int, K: int):
    """make() of one input set: a fresh weight per set (the sets rotate, so no weight stays in L2)."""
    xs = torch.tensor(6.0 / FP8_MAX, device=DEV)

    def make():
        w8, ws = _fp8(torch.randn(N, K, device=DEV) * K**-0.5)
        return torch.randn(T, K, device=DEV, dtype=BF16), w8, ws, xs

    return make


def gemv_cases() -> list[Case]:
    out = []
    for (N, K), variants in GEMV_FP8_TILE_VARIANTS.items():
        if N * K > 32 * 2**20:  # lm_head: excluded from FP8 in the published recipes
            continue
        make = _linear_make(1, N, K)
        moved = N * K + 2 * K + 2 * N
        out.append(
            Case(
                f"fp8 linear T=1 {N}x{K} (GEMV; ref: _scaled_mm)",
                make,
                fp8_linear,
                fp8.fp8_linear,
                moved,
                2 * N * K,
                fp8.fp8_linear_dequant_ref,
            )
        )
        for t in variants:
            out.append(
                Case(
                    f"fp8 gemv {N}x{K} {t}",
                    make,
                    lambda x, w, ws, xs, t=t: gemv(x, w, None, t, weight_scale=ws.reshape(1)),
                    None,
                    moved,
                    2 * N * K,
                    fp8.fp8_linear_dequant_ref,
                )
            )
    return out


def _experts(T: int):
    """make() for the FP8 routed experts at Nano shapes (routed by the reference), the bytes they move, their FLOPs
    and a BF16 op on their dequantized copy."""
    up8, up_s = _fp8(torch.randn(E, INTER, HIDDEN, device=DEV, dtype=BF16) * HIDDEN**-0.5, (1, 2))
    down8, down_s = _fp8(torch.randn(E, HIDDEN, INTER, device=DEV, dtype=BF16) * INTER**-0.5, (1, 2))
    gate = torch.randn(E, HIDDEN, device=DEV) * HIDDEN**-0.5
    in_s = (torch.tensor(6.0 / FP8_MAX, device=DEV), torch.tensor(24.0 / FP8_MAX, device=DEV))

    def make():
        x = torch.randn(T, HIDDEN, device=DEV, dtype=BF16)
        w, ids = moe.moe_route_ref(x, gate, torch.zeros(E, device=DEV), TOPK, 1, 1, True, 2.5)
        return x, up8, down8, up_s, down_s, in_s[0], in_s[1], w, ids

    up_bf, down_bf = (up8.to(BF16) * up_s[:, None, None]).to(BF16), (down8.to(BF16) * down_s[:, None, None]).to(BF16)

    def bf16(x, up8, down8, up_s, down_s, ui, di, w, ids):
        return moe_experts_tiled(x, up_bf, down_bf, w, ids, None)

    hit = E * (1 - (1 - TOPK / E) ** T)
    return make, hit * 2 * INTER * HIDDEN + T * HIDDEN * 4, T * TOPK * 4 * HIDDEN * INTER, bf16


def _tiled(x, up8, down8, up_s, down_s, ui, di, w, ids, tiles=None, w8a8=False):
    scales = Fp8ExpertScales(up_s, down_s, ui.reshape(1), di.reshape(1))
    return moe_experts_tiled(x, up8, down8, w, ids, tiles, scales, w8a8)


def _gemv(x, up8, down8, up_s, down_s, ui, di, w, ids, tiles=None, **shared):
    scales = Fp8ExpertScales(up_s, down_s, ui.reshape(1), di.reshape(1))
    return moe_experts_gemv(x, up8, down8, w, ids, tiles, scales=scales, **shared)


def moe_cases() -> list[Case]:
    out = []
    make1, moved1, flops1, _ = _experts(1)
    su, sus = _fp8(torch.randn(SHARED, HIDDEN, device=DEV) * HIDDEN**-0.5)
    sd, sds = _fp8(torch.randn(HIDDEN, SHARED, device=DEV) * SHARED**-0.5)
    shared = dict(
        shared_up=Fp8Linear(su, sus, torch.tensor(6.0 / FP8_MAX, device=DEV)),
        shared_down=Fp8Linear(sd, sds, torch.tensor(24.0 / FP8_MAX, device=DEV)),
    )
    ref1 = functools.partial(fp8.fp8_moe_experts_ref, **shared)
    for t in EXPERT_GEMV_FP8_VARIANTS:
        out.append(
            Case(
                f"fp8 moe+shared T=1 gemv {t}",
                make1,
                lambda *a, t=t: _gemv(*a, t, **shared),
                None,
                moved1 + 2 * SHARED * HIDDEN,
                flops1,
                ref1,
            )
        )
    for T in (64, 256, 512, 1024, 8192):
        make, moved, flops, bf16 = _experts(T)
        w8a8_ref = functools.partial(fp8.fp8_moe_experts_ref, quantize_activations=True)
        out += [
            Case(f"moe T={T} bf16 (dequantized copy)", make, bf16, None, 2 * moved, flops, fp8.fp8_moe_experts_ref),
            Case(f"fp8 moe T={T} weight-only", make, _tiled, None, moved, flops, fp8.fp8_moe_experts_ref),
            Case(f"fp8 moe T={T} w8a8", make, functools.partial(_tiled, w8a8=True), None, moved, flops, w8a8_ref),
        ]
        for t in W8A8_TILE_VARIANTS.get(T, ()):
            fn = functools.partial(_tiled, tiles=t, w8a8=True)
            out.append(Case(f"fp8 moe T={T} w8a8 {t}", make, fn, None, moved, flops, w8a8_ref))
    return out


def quantize_cases() -> list[Case]:
    out = []
    for T in (256, 8192):
        scale = torch.tensor([6.0 / FP8_MAX], device=DEV)

        def make(T=T, scale=scale):
            return torch.randn(T, HIDDEN, device=DEV, dtype=BF16), scale

        out.append(
            Case(
                f"quantize_fp8 T={T}",
                make,
                lambda x, s: quantize_fp8(x, s).view(torch.uint8).float(),
                lambda x, s: fp8.quantize_fp8(x, s).view(torch.uint8).float(),
                T * HIDDEN * 3,
                0.0,
            )
        )
        for t in QUANTIZE_TILE_VARIANTS:
            out.append(
                Case(
                    f"quantize_fp8 T={T} {t}",
                    make,
                    lambda x, s, t=t: quantize_fp8_tiled(x, s, t).view(torch.uint8).float(),
                    None,
                    T * HIDDEN * 3,
                    0.0,
                    lambda x, s: fp8.quantize_fp8(x, s).view(torch.uint8).float(),
                )
            )
        make_lin = _linear_make(T, 10304, HIDDEN)
        out.append(
            Case(
                f"fp8 linear T={T} 10304x{HIDDEN} (Triton quantize + _scaled_mm; ref: torch quantize)",
                make_lin,
                fp8_linear,
                fp8.fp8_linear,
                10304 * HIDDEN + T * (HIDDEN + 10304) * 2,
                2 * T * 10304 * HIDDEN,
                fp8.fp8_linear_ref,
            )
        )
    return out


def cases() -> list[Case]:
    return gemv_cases() + moe_cases() + quantize_cases()
