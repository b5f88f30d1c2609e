"""Kernel benchmarks on one CUDA GPU, Nano-30B-A3B shapes: each Triton op vs its torch reference.

For every case: wall time per call (triton.testing.do_bench median, CUDA events: includes the host's launch
overhead when the GPU outruns it), device time per call (torch.profiler: sum of the op's kernels and copies),
and over the device time the achieved GB/s (fewest bytes the op must move) and TFLOP/s (useful FLOPs), as
fractions of the ceilings measured first in the same run (device-to-device copy, read + write; an 8192^3 bf16
matmul on random data). Inputs rotate over several sets when one set would sit in L2. The `tune` group times
launch-shape variants of the Triton ops (no reference); `moe_tune` the MoE decode tile variants; `gemv` and
`moe_tune` also run the batch-1 launch-shape sweeps of benchmarks/gemv_sweep.py (single-row GEMVs; the grouped
expert GEMVs with the shared expert, as the engine calls them), a table of their own with a best-vs-default summary,
before the main table (these three groups, and `fp8` (benchmarks/fp8_cases.py: the FP8 GEMVs, grouped GEMVs, W8A8 vs
weight-only grouped GEMMs), run only when named in --only). --tiny: only the sweeps, at shrunken
sizes with one or two variants each, on the CPU interpreter when there is no GPU (a smoke test).

    PYTHONPATH=. python benchmarks/kernels.py [--only ssd,moe,tune] [--out results.md] [--log kernels.log]
    PYTHONPATH=. python benchmarks/kernels.py --only gemv,moe_tune --out tune.md --budget-s 480
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton.testing

from benchmarks import gemv_sweep, roofline
from service.engine.kernels import attention, conv1d, moe, norm, ssd
from service.engine.kernels.moe import align_by_expert_ref, max_expert_blocks
from service.engine.kernels.tiles import (
    CONV_TILE_VARIANTS,
    DECODE_TILE_VARIANTS,
    EXPERT_GEMV_TILE_VARIANTS,
    MOE_DECODE_TILE_VARIANTS,
    MoeTiles,
    PrefillTiles,
    SsdTiles,
    default_tiles,
)
from service.engine.kernels.triton_attention import paged_attention, paged_attention_tiled
from service.engine.kernels.triton_conv1d import causal_conv1d_update, causal_conv1d_varlen, causal_conv1d_varlen_tiled
from service.engine.kernels.triton_moe import moe_experts, moe_experts_tiled, moe_route
from service.engine.kernels.triton_moe_align import align_by_expert
from service.engine.kernels.triton_moe_gemv import MAX_GEMV_PAIRS, moe_experts_gemv
from service.engine.kernels.triton_norm import gated_group_rms_norm, rms_norm
from service.engine.kernels.triton_ssd import selective_state_update, ssd_varlen, ssd_varlen_tiled

DEV, BF16 = "cuda", torch.bfloat16
H, P, G, N, CHUNK, K_CONV = 64, 64, 8, 128, 128, 4  # Nano mamba
DI, CONV_DIM, HIDDEN = H * P, H * P + 2 * G * N, 2688
HQ, HKV, DH = 32, 2, 128  # Nano attention
E, TOPK, INTER = 128, 6, 1856  # Nano MoE
L2_BYTES = 60e6
TUNING_GROUPS = ("tune", "gemv", "moe_tune", "fp8")  # run only when named in --only
SWEEP_GROUPS = ("gemv", "moe_tune")  # with a gemv_sweep part


@dataclass(frozen=True)
class Case:
    name: str  # op and size
    make: Callable[[], tuple]  # builds one input set (a tuple of positional args)
    triton_fn: Callable  # the Triton op
    ref_fn: Callable | None  # the torch reference (None: too slow to time here)
    bytes_moved: float  # fewest bytes the op must read + write
    flops: float  # useful floating-point operations (0 for pure data movement)
    compare_fn: Callable | None = None  # op whose output must match (default: ref_fn)


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s on random data)."""
    return roofline.copy_gbs(DEV), roofline.matmul_tflops(DEV)


def rotating(case: Case) -> list[tuple]:
    sets = max(1, min(64, int(4 * L2_BYTES // max(case.bytes_moved, 1))))
    return [case.make() for _ in range(sets)]


def time_ms(fn: Callable, sets: list[tuple], rep: int = 200) -> float:
    it = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(it)), warmup=25, rep=rep, return_mode="median")


def rel_err(case: Case, inputs: tuple) -> float:
    """||triton - reference|| / ||reference|| of the first output (the reference is compare_fn or ref_fn)."""
    other = case.compare_fn or case.ref_fn
    if other is None:
        return float("nan")
    a, b = case.triton_fn(*inputs), other(*inputs)
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def device_ms(fn: Callable, sets: list[tuple], iters: int = 20) -> tuple[float, list[str]]:
    """GPU time per call summed over every kernel/copy the profiler saw, and a per-kernel breakdown."""
    it = itertools.cycle(sets)
    fn(*next(it))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*next(it))
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / iters) for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    return sum(t for _, t in rows) / 1000, [f"    {t:9.1f} us  {k[:90]}" for k, t in rows[:8]]


# ---------------- cases ----------------
def _ssd_case(qlens: list[int], plens: list[int]) -> Case:
    T = sum(qlens)
    layout = ssd.build_chunk_layout(qlens, plens, CHUNK, DEV)
    nc = len(layout.chunk_lens_host)

    def make():
        packed = torch.randn(T, CONV_DIM, device=DEV, dtype=BF16)
        x = packed[:, :DI].reshape(T, H, P)
        B = packed[:, DI : DI + G * N].reshape(T, G, N)
        C = packed[:, DI + G * N :].reshape(T, G, N)
        dt = ssd.dt_softplus_clamp(torch.randn(T, H, device=DEV) - 2, torch.zeros(H, device=DEV), (1e-3, 10.0))
        A = -torch.exp(torch.rand(H, device=DEV) * 2.5)
        init = torch.randn(len(qlens), H, P, N, device=DEV)
        return x, dt, A, B, C, torch.ones(H, device=DEV, dtype=BF16), init, layout

    state_bytes = H * P * N * 4
    moved = T * CONV_DIM * 2 + T * H * 4 + T * DI * 4 + (nc + len(qlens)) * state_bytes
    flops = nc * H * (2 * CHUNK * CHUNK * N * 0.75 + 2 * CHUNK * CHUNK * P * 0.75 + 4 * CHUNK * N * P)
    return Case(f"ssd_varlen T={T} reqs={len(qlens)}", make, ssd_varlen, ssd.ssd_varlen_ref, moved, flops)


def _ssu_case(b: int) -> Case:
    def make():
        return (
            torch.randn(b, H, P, N, device=DEV),
            torch.randn(b, H, P, device=DEV, dtype=BF16),
            torch.rand(b, H, device=DEV) * 0.1,
            -torch.rand(H, device=DEV),
            torch.randn(b, G, N, device=DEV, dtype=BF16),
            torch.randn(b, G, N, device=DEV, dtype=BF16),
            torch.ones(H, device=DEV, dtype=BF16),
        )

    return Case(
        f"selective_state_update B={b}",
        make,
        selective_state_update,
        ssd.selective_state_update_ref,
        2 * b * H * P * N * 4,
        0.0,
    )


def _conv_varlen_case(qlens: list[int]) -> Case:
    T = sum(qlens)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), device=DEV)
    token_req = torch.repeat_interleave(torch.arange(len(qlens), device=DEV), torch.tensor(qlens, device=DEV))

    def make():
        return (
            torch.randn(T, CONV_DIM, device=DEV, dtype=BF16),
            torch.randn(CONV_DIM, K_CONV, device=DEV, dtype=BF16),
            torch.randn(CONV_DIM, device=DEV, dtype=BF16),
            torch.randn(len(qlens), CONV_DIM, K_CONV - 1, device=DEV, dtype=BF16),
            qsl,
            token_req,
        )

    return Case(
        f"conv_varlen T={T}", make, causal_conv1d_varlen, conv1d.causal_conv1d_varlen_ref, 2 * T * CONV_DIM * 2, 0.0
    )


def _conv_update_case(b: int) -> Case:
    def make():
        return (
            torch.randn(b, CONV_DIM, device=DEV, dtype=BF16),
            torch.randn(CONV_DIM, K_CONV, device=DEV, dtype=BF16),
            torch.randn(CONV_DIM, device=DEV, dtype=BF16),
            torch.randn(b, CONV_DIM, K_CONV - 1, device=DEV, dtype=BF16),
        )

    return Case(
        f"conv_update B={b}",
        make,
        causal_conv1d_update,
        conv1d.causal_conv1d_update_ref,
        b * CONV_DIM * 2 * (2 + 2 * (K_CONV - 1)),
        0.0,
    )


def _norm_cases(T: int) -> list[Case]:
    def make_rms():
        return torch.randn(T, HIDDEN, device=DEV, dtype=BF16), torch.randn(HIDDEN, device=DEV, dtype=BF16), 1e-5

    def make_gated():
        return (
            torch.randn(T, DI, device=DEV),
            torch.randn(T, DI, device=DEV, dtype=BF16),
            torch.randn(DI, device=DEV, dtype=BF16),
            DI // G,
            1e-5,
            BF16,
        )

    return [
        Case(f"rms_norm T={T}", make_rms, rms_norm, norm.rms_norm_ref, 2 * T * HIDDEN * 2, 0.0),
        Case(
            f"gated_rms_norm T={T}",
            make_gated,
            gated_group_rms_norm,
            norm.gated_group_rms_norm_ref,
            T * DI * (4 + 2 + 2),
            0.0,
        ),
    ]


def _attn_case(qlens: list[int], plens: list[int], page: int = 64) -> Case:
    ctx = [p + q for p, q in zip(plens, qlens)]
    pages = [-(-c // page) for c in ctx]
    table = torch.zeros(len(qlens), max(pages), dtype=torch.int64)
    perm = torch.randperm(sum(pages)) + 1
    for i, n in enumerate(pages):
        table[i, :n] = perm[sum(pages[:i]) : sum(pages[:i]) + n]
    table = table.to(DEV)
    qsl = [0] + list(itertools.accumulate(qlens))
    slots = (sum(pages) + 1) * page

    def make():
        return (
            torch.randn(sum(qlens), HQ, DH, device=DEV, dtype=BF16),
            torch.randn(slots, HKV, DH, device=DEV, dtype=BF16),
            torch.randn(slots, HKV, DH, device=DEV, dtype=BF16),
            table,
            torch.tensor(qsl, device=DEV),
            torch.tensor(plens, device=DEV),
            max(qlens),
            max(ctx),
            page,
            DH**-0.5,
        )

    moved = sum(ctx) * HKV * DH * 2 * 2 + 2 * sum(qlens) * HQ * DH * 2
    flops = sum(4 * HQ * DH * q * (p + (q + 1) / 2) for p, q in zip(plens, qlens))
    kind = "decode" if all(q == 1 for q in qlens) else "prefill"
    return Case(
        f"paged_attention {kind} B={len(qlens)} ctx={max(ctx)}",
        make,
        paged_attention,
        attention.paged_attention_ref,
        moved,
        flops,
    )


def _moe_case(T: int) -> Case:
    up = torch.randn(E, INTER, HIDDEN, device=DEV, dtype=BF16) * HIDDEN**-0.5
    down = torch.randn(E, HIDDEN, INTER, device=DEV, dtype=BF16) * INTER**-0.5
    gate = torch.randn(E, HIDDEN, device=DEV) * HIDDEN**-0.5  # router logits ~ N(0, 1): no saturated ties

    def make():
        x = torch.randn(T, HIDDEN, device=DEV, dtype=BF16)
        w, ids = moe.moe_route_ref(x, gate, torch.zeros(E, device=DEV), TOPK, 1, 1, True, 2.5)
        return x, up, down, w, ids

    experts_hit = E * (1 - (1 - TOPK / E) ** T)  # expected distinct experts (uniform routing)
    moved = experts_hit * 2 * INTER * HIDDEN * 2 + T * HIDDEN * 2 * 2
    return Case(
        f"moe_experts T={T}",
        make,
        moe_experts,
        moe.moe_experts_ref if T <= 8192 else None,
        moved,
        T * TOPK * 4 * HIDDEN * INTER,
    )


def _moe_route_case(T: int) -> Case:
    """The router (fp32 h @ W^T, sigmoid, bias, top-6, weights) at Nano shapes; a fresh gate per input set."""

    def make():
        return (
            torch.randn(T, HIDDEN, device=DEV, dtype=BF16),
            torch.randn(E, HIDDEN, device=DEV) * HIDDEN**-0.5,
            torch.randn(E, device=DEV) * 0.1,
            TOPK,
            1,
            1,
            True,
            2.5,
        )

    moved = E * HIDDEN * 4 + T * HIDDEN * 2 + T * TOPK * (4 + 8)
    return Case(f"moe_route T={T}", make, moe_route, moe.moe_route_ref, moved, 2 * T * E * HIDDEN)


def _alignment_tensors(al) -> tuple:
    return al.sorted_pairs, al.block_expert  # rel err column: sorted_pairs vs the oracle's (must be 0)


def _align_case(T: int) -> Case:
    """Expert alignment of T*6 routed pairs (distinct experts per token) at the block_m moe_experts uses for T."""
    bm = default_tiles(T * TOPK / E, 2).block_m

    def make():
        return (torch.rand(T, E, device=DEV).argsort(dim=1)[:, :TOPK].contiguous(),)

    moved = T * TOPK * 8 + max_expert_blocks(T * TOPK, E, bm) * (bm + 1) * 4
    return Case(
        f"align_by_expert T={T} block_m={bm}",
        make,
        lambda ids: _alignment_tensors(align_by_expert(ids, E, bm)),
        lambda ids: _alignment_tensors(align_by_expert_ref(ids, E, bm)),
        moved,
        0.0,
    )


def _ids_first(route_out: tuple) -> tuple:
    return route_out[1], route_out[0]  # rel err column: ids vs moe_route_ref's (0: the same experts)


def route_cases() -> list[Case]:
    """moe_route and align_by_expert at T = 1, 256, 8192 (defaults, vs the torch references), then every launch-shape
    variant of ROUTE_TILE_VARIANTS / ALIGN_TILE_VARIANTS (first of each = the default; each checked by the GPU
    tests); variant rows' rel err: the ids vs moe_route_ref's / sorted_pairs vs the oracle's, 0 when equal."""
    from service.engine.kernels.tiles import ALIGN_TILE_VARIANTS, ROUTE_TILE_VARIANTS
    from service.engine.kernels.triton_moe_align import align_into
    from service.engine.kernels.triton_moe_route import moe_route_tiled

    out = [_moe_route_case(t) for t in (1, 256, 8192)] + [_align_case(t) for t in (1, 256, 8192)]
    for T, variants in ROUTE_TILE_VARIANTS.items():
        base = _moe_route_case(T)
        for t in variants:
            grid = (triton.cdiv(T, t.block_t), triton.cdiv(E, t.block_e), triton.cdiv(HIDDEN, t.block_k * t.k_steps))
            name = (
                f"route {base.name} {t.mode} bt={t.block_t} be={t.block_e} bk={t.block_k}x{t.k_steps} "
                f"w={t.warps} s={t.stages} sel={t.select_rows} grid={grid}"
            )
            out.append(
                Case(
                    name,
                    base.make,
                    lambda *a, t=t: _ids_first(moe_route_tiled(*a, t)),
                    None,
                    base.bytes_moved,
                    base.flops,
                    lambda *a: _ids_first(moe.moe_route_ref(*a)),
                )
            )
    for T, variants in ALIGN_TILE_VARIANTS.items():
        base, bm = _align_case(T), default_tiles(T * TOPK / E, 2).block_m
        blocks = max_expert_blocks(T * TOPK, E, bm)

        def aligned(ids, t, bm=bm, blocks=blocks):
            return _alignment_tensors(
                align_into(
                    ids,
                    E,
                    bm,
                    torch.empty(blocks * bm, dtype=torch.int32, device=DEV),
                    torch.empty(blocks, dtype=torch.int32, device=DEV),
                    t,
                )
            )

        for t in variants:
            out.append(
                Case(
                    f"route {base.name} {t}",
                    base.make,
                    lambda ids, t=t, f=aligned: f(ids, t),
                    None,
                    base.bytes_moved,
                    0.0,
                    base.ref_fn,
                )
            )
    return out


def _fp8_cases() -> list[Case]:
    from benchmarks import fp8_cases  # imports this module's Case: loaded on use

    return fp8_cases.cases()


def all_cases(only: set[str]) -> list[Case]:
    groups = {
        "ssd": lambda: [_ssd_case([8192], [0]), _ssd_case([1024 + 37] * 7 + [1024 - 7 * 37], [91] * 8)],
        "ssu": lambda: [_ssu_case(b) for b in (1, 32, 128)],
        "conv": lambda: [_conv_varlen_case([8192]), _conv_update_case(128)],
        "norm": lambda: _norm_cases(8192),
        "attn": lambda: [
            _attn_case([1], [8191]),
            _attn_case([1] * 32, [1023] * 32),
            _attn_case([1] * 128, [1023] * 128),
            _attn_case([8192], [0]),
            _attn_case([1024] * 4, [512, 0, 300, 2000]),
        ],
        "moe": lambda: [_moe_case(t) for t in (1, 32, 128, 8192)],
        "route": route_cases,
        "tune": tune_cases,
        "gemv": lambda: [],  # only the sweep (gemv_sweep.gemv_case)
        "moe_tune": moe_tune_cases,
        "fp8": _fp8_cases,
    }
    return [
        c for name, make in groups.items() if (not only and name not in TUNING_GROUPS) or name in only for c in make()
    ]


@dataclass(frozen=True)
class Selection:
    """Which main-table cases this process runs."""

    match: tuple[str, ...] = ()  # run only cases whose name contains one of these (empty: every case)
    warm_only: bool = False  # compile each selected case (one call), no timing
    shard: tuple[int, int] = (0, 1)  # (i, n): with warm_only, every n-th selected case from the i-th

    def picks(self, cases: list[Case]) -> list[Case]:
        chosen = [c for c in cases if not self.match or any(m in c.name for m in self.match)]
        return chosen[self.shard[0] :: self.shard[1]] if self.warm_only else chosen


def run(
    only: set[str],
    log: list[str],
    ceilings: tuple[float, float],
    deadline: float = math.inf,
    selection: Selection = Selection(),
) -> list[str]:
    copy_gbs, mm_tflops = ceilings
    lines = [
        "| case | wall ms | device ms | torch ref wall ms | speedup | GB/s | % copy BW | TFLOP/s | % bf16 peak "
        "| rel err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for case in selection.picks(all_cases(only)):
        if selection.warm_only:
            case.triton_fn(*case.make())
            print(f"| {case.name} | compiled |", flush=True)
            continue
        if time.monotonic() > deadline:
            lines.append(f"| {case.name} | skipped: past --budget-s |")
            continue
        sets = rotating(case)
        t = time_ms(case.triton_fn, sets)
        t_dev, breakdown = device_ms(case.triton_fn, sets)
        t_ref = time_ms(case.ref_fn, sets[:2], rep=50) if case.ref_fn is not None else float("nan")
        gbs, tfl = case.bytes_moved / t_dev / 1e6, case.flops / t_dev / 1e9
        line = (
            f"| {case.name} | {t:.4f} | {t_dev:.4f} | {t_ref:.3f} | {t_ref / t:.1f}x | {gbs:.0f} "
            f"| {100 * gbs / copy_gbs:.0f}% | {tfl:.1f} | {100 * tfl / mm_tflops:.1f}% "
            f"| {rel_err(case, sets[0]):.1e} |"
        )
        print(line, flush=True)
        lines.append(line)
        log += [case.name] + breakdown
        del sets
        torch.cuda.empty_cache()
    return lines


def sweep_cases(only: set[str], tiny: bool, device: str) -> list[gemv_sweep.SweepCase]:
    """The gemv_sweep cases of the named groups (Nano shapes from the repo's config, or gemv_sweep.TINY)."""
    shapes = gemv_sweep.TINY if tiny else gemv_sweep.nano_shapes()
    out = []
    if "gemv" in only:
        out += [
            gemv_sweep.gemv_case(name, n, k, device, tiny, proxies=not tiny or i == 0)
            for i, (name, n, k) in enumerate(shapes.gemv)
        ]
    if "moe_tune" in only:
        out += gemv_sweep.moe_cases(shapes, device, tiny)
    return out


def tune_cases() -> list[Case]:
    """Launch-shape variants of the Triton ops at prefill/decode sizes (first of each family = previous default)."""
    out = []
    ssd_case = _ssd_case([8192], [0])
    for tiles in (
        SsdTiles(64, 64, 4, 256, 64),
        SsdTiles(128, 64, 4, 256, 64),
        SsdTiles(64, 32, 4, 256, 32),
        SsdTiles(128, 32, 8, 256, 32),
    ):
        out.append(
            Case(
                f"tune {ssd_case.name} {tiles}",
                ssd_case.make,
                lambda *a, tiles=tiles: ssd_varlen_tiled(*a, tiles),
                None,
                ssd_case.bytes_moved,
                ssd_case.flops,
                ssd_varlen,
            )
        )
    attn = _attn_case([8192], [0])
    for tiles in (PrefillTiles(128, 64, 8, 2), PrefillTiles(128, 128, 8, 3), PrefillTiles(64, 128, 4, 2)):
        out.append(
            Case(
                f"tune {attn.name} {tiles}",
                attn.make,
                lambda *a, tiles=tiles: paged_attention_tiled(*a, tiles),
                None,
                attn.bytes_moved,
                attn.flops,
                paged_attention,
            )
        )
    base = _moe_case(8192)
    for tiles in (MoeTiles(128, 128, 64, 8, 3), MoeTiles(128, 256, 64, 8, 4), MoeTiles(256, 128, 64, 8, 3)):
        out.append(
            Case(
                f"tune {base.name} {tiles}",
                base.make,
                lambda *a, tiles=tiles: moe_experts_tiled(*a, tiles),
                None,
                base.bytes_moved,
                base.flops,
                moe_experts,
            )
        )
    conv = _conv_varlen_case([8192])
    for tiles in CONV_TILE_VARIANTS:  # first = the default; each checked by the GPU tests
        out.append(
            Case(
                f"tune {conv.name} {tiles}",
                conv.make,
                lambda *a, tiles=tiles: causal_conv1d_varlen_tiled(*a, tiles),
                None,
                conv.bytes_moved,
                0.0,
                causal_conv1d_varlen,
            )
        )
    for b, ctx in ((1, 8192), (32, 1024), (128, 1024), (256, 2048)):
        dec = _attn_case([1] * b, [ctx - 1] * b)
        for tiles in DECODE_TILE_VARIANTS:  # first = the default; each checked by the GPU tests
            out.append(
                Case(
                    f"tune {dec.name} {tiles}",
                    dec.make,
                    lambda *a, tiles=tiles: paged_attention_tiled(*a, PrefillTiles(), tiles),
                    None,
                    dec.bytes_moved,
                    dec.flops,
                    paged_attention,
                )
            )
    return out


def moe_tune_cases() -> list[Case]:
    """Routed experts at decode sizes T = 1, 2, 8, 64 over MOE_DECODE_TILE_VARIANTS (first = the default), and the
    grouped-GEMV experts (`triton_moe_gemv`) where T * k fits, each compared with moe_experts_ref (rel err column).
    The batch-1 case with the shared expert and its tile sweep: `sweep_cases` (gemv_sweep.moe_cases)."""
    out = []
    for T in (1, 2, 8, 64):
        base = _moe_case(T)
        for tiles in MOE_DECODE_TILE_VARIANTS:
            out.append(
                Case(
                    f"moe_tune {base.name} {tiles}",
                    base.make,
                    lambda *a, tiles=tiles: moe_experts_tiled(*a, tiles),
                    None,
                    base.bytes_moved,
                    base.flops,
                    moe.moe_experts_ref,
                )
            )
        if T * TOPK <= MAX_GEMV_PAIRS:  # grouped-GEMV experts (no alignment, no padded rows)
            for tiles in EXPERT_GEMV_TILE_VARIANTS:
                out.append(
                    Case(
                        f"moe_tune {base.name} gemv {tiles}",
                        base.make,
                        lambda *a, tiles=tiles: moe_experts_gemv(*a, tiles),
                        None,
                        base.bytes_moved,
                        base.flops,
                        moe.moe_experts_ref,
                    )
                )
    return out


def compiled_kernel_report() -> list[str]:
    """Registers, spills and shared memory of every compiled Triton kernel of the Triton backend modules."""
    from service.engine.kernels import (
        triton_attention,
        triton_conv1d,
        triton_moe,
        triton_moe_route,
        triton_norm,
        triton_ssd,
    )

    out = []
    from service.engine.kernels import triton_gemv, triton_moe_align, triton_moe_gemv

    mods = (triton_ssd, triton_conv1d, triton_attention, triton_moe, triton_moe_route, triton_norm)
    for mod in mods + (triton_gemv, triton_moe_gemv, triton_moe_align):
        for name, fn in vars(mod).items():
            for cache in getattr(fn, "device_caches", {}).values():
                kernels = cache[0] if isinstance(cache, tuple) and isinstance(cache[0], dict) else {}
                for kernel in kernels.values():
                    meta = kernel.metadata
                    out.append(
                        f"{name} warps={meta.num_warps} stages={meta.num_stages} "
                        f"regs={getattr(kernel, 'n_regs', '?')} spills={getattr(kernel, 'n_spills', '?')} "
                        f"shared={meta.shared}"
                    )
    return sorted(set(out))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        default="",
        help="comma list of groups: ssd,ssu,conv,norm,attn,moe,route (run only when named: tune,gemv,moe_tune,fp8)",
    )
    ap.add_argument("--out", default="", help="also write the tables to this file (rewritten after every sweep row)")
    ap.add_argument("--log", default="", help="write per-kernel device-time breakdowns and register use here")
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="only the gemv/moe_tune sweeps, shrunken, 1-2 variants "
        "each; runs on the CPU interpreter (TRITON_INTERPRET=1) when there is no GPU",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no case after this many seconds from "
        "launch (the rest is listed as skipped, the summary covers what ran); 0 = no limit",
    )
    ap.add_argument("--match", default="", help="comma list: run only main-table cases whose name contains one")
    ap.add_argument(
        "--warm-only",
        default="",
        metavar="I/N",
        help="compile (one call each, no timing) every N-th selected main-table case from the I-th, so that N "
        "processes fill Triton's cache in parallel before the timed run",
    )
    args = ap.parse_args(argv)
    shard = tuple(int(v) for v in args.warm_only.split("/")) if args.warm_only else (0, 1)
    selection = Selection(tuple(m for m in args.match.split(",") if m), bool(args.warm_only), shard)
    start = time.monotonic()
    deadline = start + args.budget_s if args.budget_s > 0 else math.inf
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    only = {s for s in args.only.split(",") if s}
    if args.tiny:
        only = only & set(SWEEP_GROUPS) or set(SWEEP_GROUPS)
    torch.manual_seed(0)
    device = "cuda" if cuda else "cpu"
    if args.tiny:
        ceilings = (gemv_sweep.small_copy_gbs(device), math.nan)
    else:
        ceilings = (math.nan, math.nan) if selection.warm_only else measure_ceilings()
    gpu = f"GPU: {torch.cuda.get_device_name()}" if cuda else "CPU (Triton interpreter)"
    head = [
        f"{gpu}, torch {torch.__version__}, triton {triton.__version__}",
        "",
        f"ceilings: copy {ceilings[0]:.0f} GB/s (read+write), bf16 matmul {ceilings[1]:.0f} TFLOP/s",
        "",
    ]
    print("\n".join(head), flush=True)
    sweep_rows: list[str] = []

    def write_out(tail: list[str]) -> None:
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("\n".join(head + tail) + "\n")

    def emit(row: str) -> None:
        print(row, flush=True)
        sweep_rows.append(row)
        write_out(gemv_sweep.HEADER + sweep_rows)

    cases = sweep_cases(only, args.tiny, device)
    sweep = []
    if cases:
        print("\n".join(gemv_sweep.HEADER), flush=True)
        rows, summary = gemv_sweep.run(cases, ceilings[0], device, args.tiny, deadline, emit)
        sweep = gemv_sweep.HEADER + rows + summary + [""]
        print("\n".join(summary) + "\n", flush=True)
        write_out(sweep)
    log: list[str] = []
    if not args.tiny and (not only or only - {"gemv"}):  # "gemv" alone has no main-table cases
        lines = run(only, log, ceilings, deadline, selection)
        write_out(sweep + lines)
        if cases:  # the sweep's summary last again
            print("\n".join(summary), flush=True)
    print(f"total {time.monotonic() - start:.0f} s", flush=True)
    if args.log:
        with open(args.log, "w", encoding="utf-8") as f:
            f.write("\n".join(log + [""] + compiled_kernel_report()) + "\n")


if __name__ == "__main__":
    main()
