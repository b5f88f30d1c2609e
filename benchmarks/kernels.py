"""Kernel benchmarks on one CUDA GPU, Nano-30B-A3B shapes: each Triton op vs its torch reference.

For every case: median time (triton.testing.do_bench, CUDA events), achieved GB/s over the fewest bytes the
op must move and TFLOP/s over its useful FLOPs, as fractions of the ceilings measured first in the same run
(device-to-device copy bandwidth, counting read + write; an 8192^3 bf16 matmul on random data).
Inputs rotate over several sets when one set would sit in L2.

    python benchmarks/kernels.py [--only ssd,moe] [--out results.md]
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import triton.testing

from service.engine.kernels import attention, conv1d, moe, norm, ssd
from service.engine.kernels.triton_attention import paged_attention
from service.engine.kernels.triton_conv1d import causal_conv1d_update, causal_conv1d_varlen
from service.engine.kernels.triton_moe import moe_experts
from service.engine.kernels.triton_norm import gated_group_rms_norm, rms_norm
from service.engine.kernels.triton_ssd import selective_state_update, ssd_varlen

DEV, BF16 = "cuda", torch.bfloat16
H, P, G, N, CHUNK, K_CONV = 64, 64, 8, 128, 128, 4           # Nano mamba
DI, CONV_DIM, HIDDEN = H * P, H * P + 2 * G * N, 2688
HQ, HKV, DH = 32, 2, 128                                     # Nano attention
E, TOPK, INTER = 128, 6, 1856                                # Nano MoE
L2_BYTES = 60e6


@dataclass(frozen=True)
class Case:
    name: str                       # op and size
    make: Callable[[], tuple]       # builds one input set (a tuple of positional args)
    triton_fn: Callable             # the Triton op
    ref_fn: Callable | None         # the torch reference (None: too slow to time here)
    bytes_moved: float              # fewest bytes the op must read + write
    flops: float                    # useful floating-point operations (0 for pure data movement)


def measure_ceilings() -> tuple[float, float]:
    """(copy GB/s counting read + write, bf16 matmul TFLOP/s on random data)."""
    a = torch.randn(2 ** 29, device=DEV, dtype=BF16)          # 1 GiB
    b = torch.empty_like(a)
    t_copy = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    x = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    y = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t_mm = triton.testing.do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 2 / t_copy / 1e6, 2 * 8192 ** 3 / t_mm / 1e9


def rotating(case: Case) -> list[tuple]:
    sets = max(1, min(64, int(4 * L2_BYTES // max(case.bytes_moved, 1))))
    return [case.make() for _ in range(sets)]


def time_ms(fn: Callable, sets: list[tuple], rep: int = 200) -> float:
    it = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn(*next(it)), warmup=25, rep=rep, return_mode="median")


# ---------------- cases ----------------
def _ssd_case(qlens: list[int], plens: list[int]) -> Case:
    T = sum(qlens)
    layout = ssd.build_chunk_layout(qlens, plens, CHUNK, DEV)
    nc = len(layout.chunk_lens_host)

    def make():
        packed = torch.randn(T, CONV_DIM, device=DEV, dtype=BF16)
        x = packed[:, :DI].reshape(T, H, P)
        B = packed[:, DI:DI + G * N].reshape(T, G, N)
        C = packed[:, DI + G * N:].reshape(T, G, N)
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
        return (torch.randn(b, H, P, N, device=DEV), torch.randn(b, H, P, device=DEV, dtype=BF16),
                torch.rand(b, H, device=DEV) * 0.1, -torch.rand(H, device=DEV),
                torch.randn(b, G, N, device=DEV, dtype=BF16), torch.randn(b, G, N, device=DEV, dtype=BF16),
                torch.ones(H, device=DEV, dtype=BF16))
    return Case(f"selective_state_update B={b}", make, selective_state_update, ssd.selective_state_update_ref,
                2 * b * H * P * N * 4, 0.0)


def _conv_varlen_case(qlens: list[int]) -> Case:
    T = sum(qlens)
    qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), device=DEV)
    token_req = torch.repeat_interleave(torch.arange(len(qlens), device=DEV), torch.tensor(qlens, device=DEV))

    def make():
        return (torch.randn(T, CONV_DIM, device=DEV, dtype=BF16), torch.randn(CONV_DIM, K_CONV, device=DEV, dtype=BF16),
                torch.randn(CONV_DIM, device=DEV, dtype=BF16),
                torch.randn(len(qlens), CONV_DIM, K_CONV - 1, device=DEV, dtype=BF16), qsl, token_req)
    return Case(f"conv_varlen T={T}", make, causal_conv1d_varlen, conv1d.causal_conv1d_varlen_ref,
                2 * T * CONV_DIM * 2, 0.0)


def _conv_update_case(b: int) -> Case:
    def make():
        return (torch.randn(b, CONV_DIM, device=DEV, dtype=BF16), torch.randn(CONV_DIM, K_CONV, device=DEV, dtype=BF16),
                torch.randn(CONV_DIM, device=DEV, dtype=BF16),
                torch.randn(b, CONV_DIM, K_CONV - 1, device=DEV, dtype=BF16))
    return Case(f"conv_update B={b}", make, causal_conv1d_update, conv1d.causal_conv1d_update_ref,
                b * CONV_DIM * 2 * (2 + 2 * (K_CONV - 1)), 0.0)


def _norm_cases(T: int) -> list[Case]:
    def make_rms():
        return torch.randn(T, HIDDEN, device=DEV, dtype=BF16), torch.randn(HIDDEN, device=DEV, dtype=BF16), 1e-5

    def make_gated():
        return (torch.randn(T, DI, device=DEV), torch.randn(T, DI, device=DEV, dtype=BF16),
                torch.randn(DI, device=DEV, dtype=BF16), DI // G, 1e-5, BF16)
    return [Case(f"rms_norm T={T}", make_rms, rms_norm, norm.rms_norm_ref, 2 * T * HIDDEN * 2, 0.0),
            Case(f"gated_rms_norm T={T}", make_gated, gated_group_rms_norm, norm.gated_group_rms_norm_ref,
                 T * DI * (4 + 2 + 2), 0.0)]


def _attn_case(qlens: list[int], plens: list[int], page: int = 64) -> Case:
    ctx = [p + q for p, q in zip(plens, qlens)]
    pages = [-(-c // page) for c in ctx]
    table = torch.zeros(len(qlens), max(pages), dtype=torch.int64)
    perm = torch.randperm(sum(pages)) + 1
    for i, n in enumerate(pages):
        table[i, :n] = perm[sum(pages[:i]):sum(pages[:i]) + n]
    table = table.to(DEV)
    qsl = [0] + list(itertools.accumulate(qlens))
    slots = (sum(pages) + 1) * page

    def make():
        return (torch.randn(sum(qlens), HQ, DH, device=DEV, dtype=BF16),
                torch.randn(slots, HKV, DH, device=DEV, dtype=BF16), torch.randn(slots, HKV, DH, device=DEV, dtype=BF16),
                table, qsl, plens, page, DH ** -0.5)
    moved = sum(ctx) * HKV * DH * 2 * 2 + 2 * sum(qlens) * HQ * DH * 2
    flops = sum(4 * HQ * DH * q * (p + (q + 1) / 2) for p, q in zip(plens, qlens))
    kind = "decode" if all(q == 1 for q in qlens) else "prefill"
    return Case(f"paged_attention {kind} B={len(qlens)} ctx={max(ctx)}", make, paged_attention,
                attention.paged_attention_ref, moved, flops)


def _moe_case(T: int) -> Case:
    up = torch.randn(E, INTER, HIDDEN, device=DEV, dtype=BF16) * HIDDEN ** -0.5
    down = torch.randn(E, HIDDEN, INTER, device=DEV, dtype=BF16) * INTER ** -0.5
    gate = torch.randn(E, HIDDEN, device=DEV)

    def make():
        x = torch.randn(T, HIDDEN, device=DEV, dtype=BF16)
        w, ids = moe.moe_route_ref(x, gate, torch.zeros(E, device=DEV), TOPK, 1, 1, True, 2.5)
        return x, up, down, w, ids
    experts_hit = min(E, T * TOPK) if T < 64 else E                  # distinct experts touched (upper bound)
    moved = experts_hit * 2 * INTER * HIDDEN * 2 + T * HIDDEN * 2 * 2
    return Case(f"moe_experts T={T}", make, moe_experts, moe.moe_experts_ref if T <= 8192 else None, moved,
                T * TOPK * 4 * HIDDEN * INTER)


def all_cases(only: set[str]) -> list[Case]:
    groups = {
        "ssd": lambda: [_ssd_case([8192], [0]), _ssd_case([1024 + 37] * 7 + [1024 - 7 * 37], [91] * 8)],
        "ssu": lambda: [_ssu_case(b) for b in (1, 32, 128)],
        "conv": lambda: [_conv_varlen_case([8192]), _conv_update_case(128)],
        "norm": lambda: _norm_cases(8192),
        "attn": lambda: [_attn_case([1], [8191]), _attn_case([1] * 32, [1023] * 32), _attn_case([1] * 128, [1023] * 128),
                         _attn_case([8192], [0]), _attn_case([1024] * 4, [512, 0, 300, 2000])],
        "moe": lambda: [_moe_case(t) for t in (1, 32, 128, 8192)],
    }
    return [c for name, make in groups.items() if not only or name in only for c in make()]


def run(only: set[str]) -> list[str]:
    copy_gbs, mm_tflops = measure_ceilings()
    lines = [f"ceilings: copy {copy_gbs:.0f} GB/s (read+write), bf16 matmul {mm_tflops:.0f} TFLOP/s", "",
             "| case | triton ms | torch ref ms | speedup | GB/s | % copy BW | TFLOP/s | % bf16 peak |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    print("\n".join(lines), flush=True)
    for case in all_cases(only):
        sets = rotating(case)
        t = time_ms(case.triton_fn, sets)
        t_ref = time_ms(case.ref_fn, sets[:2], rep=50) if case.ref_fn is not None else float("nan")
        gbs, tfl = case.bytes_moved / t / 1e6, case.flops / t / 1e9
        line = (f"| {case.name} | {t:.4f} | {t_ref:.3f} | {t_ref / t:.1f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% "
                f"| {tfl:.1f} | {100 * tfl / mm_tflops:.1f}% |")
        print(line, flush=True)
        lines.append(line)
        del sets
        torch.cuda.empty_cache()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of groups: ssd,ssu,conv,norm,attn,moe")
    ap.add_argument("--out", default="", help="also write the table to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    lines = run({s for s in args.only.split(",") if s})
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n\n")
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
