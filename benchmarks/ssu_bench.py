"""The decode SSM state update at Nano's shapes (64 heads x 64 x 128 state, 8 groups) and large batches: each launch
shape of `triton_ssd.SSU_TILE_VARIANTS` (the engine takes `triton_ssd.ssu_tiles(B)`), fp32 and bf16 state pools,
checked against the reference and timed.

The floor is the state's bytes (read and written once, 2 * B * H * P * N * elem) over the measured copy bandwidth
(`roofline.copy_gbs`); a pool of B + 1 slots in a shuffled order (as the engine's slots are), far above L2.

    PYTHONPATH=. python benchmarks/ssu_bench.py [--batches 256,512,1024] [--out ssu.md]
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from benchmarks import roofline
from service.engine.kernels import ssd, triton_ssd

H, P, G, N = 64, 64, 8, 128  # Nano-30B-A3B
CLAMP = (1e-3, float("inf"))


def inputs(batch: int, state_dtype: torch.dtype, seed: int) -> tuple:
    """(pool [B+1, H, P, N], slot ids [B] (a permutation of 1..B), x, raw dt, A_log, B, C, D, dt_bias): x/B/C/dt are
    strided splits of one bf16 in_proj-like row, as in the mamba layer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    di, gn = H * P, G * N
    packed = torch.randn(batch, di + 2 * gn + H, generator=g, device="cuda").to(torch.bfloat16)
    x = packed[:, :di].view(batch, H, P)
    Bm = packed[:, di : di + gn].view(batch, G, N)
    Cm = packed[:, di + gn : di + 2 * gn].view(batch, G, N)
    dt = packed[:, di + 2 * gn :]
    pool = torch.randn(batch + 1, H, P, N, generator=g, device="cuda").to(state_dtype)
    slots = torch.randperm(batch, generator=g, device="cuda") + 1
    A_log = torch.rand(H, generator=g, device="cuda")
    D = torch.randn(H, generator=g, device="cuda").to(torch.bfloat16)
    dt_bias = torch.randn(H, generator=g, device="cuda").to(torch.bfloat16)
    return pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(tiles: triton_ssd.SsuTiles, state_dtype: torch.dtype) -> tuple[float, float]:
    """(rel err of y, rel err of the new states) against the reference at batch 64 on fresh random inputs."""
    pool, slots, *rest = inputs(64, state_dtype, seed=11)
    ref_pool = pool.clone()
    y = triton_ssd.selective_state_update_slots_raw_dt(pool, slots, *rest, CLAMP, tiles)
    y_ref = ssd.selective_state_update_slots_raw_dt_ref(ref_pool, slots, *rest, CLAMP)
    return rel_err(y, y_ref), rel_err(pool[slots], ref_pool[slots])


def time_ms(tiles: triton_ssd.SsuTiles, batch: int, state_dtype: torch.dtype) -> float:
    pool, slots, *rest = inputs(batch, state_dtype, seed=batch)
    fn = lambda: triton_ssd.selective_state_update_slots_raw_dt(pool, slots, *rest, CLAMP, tiles)  # noqa: E731
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    copy = roofline.copy_gbs()
    lines = [
        f"copy bandwidth {copy:.0f} GB/s; state {H}x{P}x{N} per head, {H} heads, one layer",
        "| state | tiles (block_p, warps) | rel err y / state | "
        + " | ".join(f"B={b} ms (% of copy)" for b in args.batches.split(","))
        + " |",
        "| --- | --- | --- |" + " ---: |" * len(args.batches.split(",")),
    ]
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for tiles in triton_ssd.SSU_TILE_VARIANTS:
            ey, es = check(tiles, dtype)
            cells = []
            for b in (int(x) for x in args.batches.split(",")):
                ms = time_ms(tiles, b, dtype)
                floor = 2 * b * H * P * N * dtype.itemsize / copy / 1e6
                cells.append(f"{ms:.3f} ({100 * floor / ms:.0f} %)")
            lines.append(
                f"| {name} | {tiles.block_p}, {tiles.warps} | {ey:.1e} / {es:.1e} | " + " | ".join(cells) + " |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
