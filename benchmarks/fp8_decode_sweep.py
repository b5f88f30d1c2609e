"""The batch-1 FP8 decode kernels timed as a decode step runs them: CUDA-graph chains of PDL launches, each launch on
its own weights.

A batch-1 launch lasts ~5-30 us, so one launch timed alone (do_bench) mostly reads its host overhead. Here every
case is a chain of --layers launches, each on a distinct weight set (the chain is far above L2, as a decode step's
layers are), captured in one CUDA graph and replayed back to back (CUDA events, median of --reps replays): device us
per launch and the weight GB/s it reaches, with the launch ramps and PDL overlaps of a real step. Cases (Nano-30B-A3B):
- `gemv`: the FP8 GEMV (`triton_gemv.gemv`, weight-only) at the FP8 linear shapes (mamba in_proj 10304 x 2688,
  out_proj 2688 x 4096) over `GEMV_FP8_TILE_VARIANTS` and the GEMV_EXTRA launch shapes.
- `up` / `down`: one pass of the batch-1 MoE layer's grouped GEMVs (top-6 routed + the shared expert as a 7th slot,
  FP8) over EXPERT_SWEEP (the down pass: with the shared expert's K in two chunks, DOWN_SWEEP; it includes the
  slot sum); `moe`: the whole op (up + down + slot sum) for the tile pairs of
  `EXPERT_GEMV_FP8_TILE_VARIANTS` and the best up / down pair found, the slots summed by `sum_slots` (3 launches) or
  in the down pass (2 launches, persistent arrival counters), FP8 and BF16.
Each row carries the relative error of its first launch against the torch reference. --warm-only compiles the
variants of shard i of n (one launch each, no timing) so several processes can fill Triton's cache in parallel.

    PYTHONPATH=. python benchmarks/fp8_decode_sweep.py [--only gemv,up,down,moe] [--layers 20] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from collections.abc import Callable

import torch

from service.engine.kernels import fp8, moe
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear
from service.engine.kernels.tiles import EXPERT_GEMV_FP8_TILE_VARIANTS, GEMV_FP8_TILE_VARIANTS, ExpertGemvTiles
from service.engine.kernels.tiles import GemvTiles as G
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import Fp8ExpertScales
from service.engine.kernels.triton_moe_gemv import expert_down_pass, expert_up_pass, moe_experts_gemv

DEV, BF16 = "cuda", torch.bfloat16
E, TOPK, D, INTER, SHARED = 128, 6, 2688, 1856, 3712
X = ExpertGemvTiles
GEMV_EXTRA = {
    (10304, 2688): (
        G(16, 512, 4),
        G(16, 512, 8),
        G(8, 1024, 8),
        G(32, 256, 8),
        G(16, 1024, 8),
        G(64, 128, 4, mma=4),
        G(64, 128, 4, mma=6),
        G(64, 256, 4, mma=3),
        G(64, 256, 4, mma=4),
        G(32, 256, 4, mma=4),
        G(128, 128, 8, mma=4),
        G(64, 128, 4, split_k=2, mma=4),
    ),
    (2688, 4096): (
        G(8, 1024, 8),
        G(8, 512, 4, split_k=2),
        G(16, 512, 8, split_k=2),
        G(4, 1024, 4, split_k=2),
        G(8, 1024, 8, split_k=2),
        G(64, 128, 4, split_k=2, mma=4),
        G(64, 256, 4, split_k=2, mma=3),
        G(32, 128, 4, split_k=4, mma=4),
        G(64, 128, 4, split_k=8, mma=3),
        G(128, 128, 8, split_k=4, mma=4),
        G(32, 256, 4, split_k=4, mma=4),
        G(64, 256, 4, split_k=4, mma=3),
    ),
}
EXPERT_SWEEP = (
    X(64, 128, 4, mma=4),
    X(64, 128, 4, mma=3),
    X(64, 128, 4, mma=5),
    X(64, 128, 4, mma=6),
    X(64, 256, 4, mma=3),
    X(64, 256, 4, mma=4),
    X(32, 128, 4, mma=4),
    X(32, 256, 4, mma=4),
    X(32, 256, 4, mma=3),
    X(16, 256, 4, mma=4),
    X(128, 128, 8, mma=3),
    X(128, 128, 8, mma=4),
    X(4, 1024, 4),
    X(8, 1024, 8),
)

# the down pass: the first tile with the shared expert as one unit, then every tile with it in two K chunks
DOWN_SWEEP = EXPERT_SWEEP[:1] + tuple(dataclasses.replace(t, shared_chunks=2) for t in EXPERT_SWEEP)


def q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 weight, fp32 per-tensor scale [1])."""
    s = (w.abs().amax() / FP8_MAX).float().reshape(1)
    return (w / s).to(FP8_DTYPE), s


def chain_us(launch: Callable[[int], object], layers: int, reps: int) -> float:
    """launch(i) for i < layers captured in one CUDA graph (after an eager pass that compiles), replayed reps times:
    the median device us per launch."""
    for i in range(layers):
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            launch(i)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times) * 1e3 / layers


def short(variant: str) -> str:
    """A variant's printed name: the tiles' values without field names (G = GemvTiles, X = ExpertGemvTiles)."""
    return re.sub(r"\w+=", "", variant.replace("ExpertGemvTiles(", "X(").replace("GemvTiles(", "G("))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


class Sweep:
    """Inputs of `layers` layers and the rows timed so far (each: case, variant, us, GB/s, rel err)."""

    def __init__(self, layers: int, reps: int, warm_only: bool, shard: tuple[int, int]):
        self.layers, self.reps, self.warm_only, self.shard = (1 if warm_only else layers), reps, warm_only, shard
        self.rows: list[dict] = []
        self.counters = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)
        self._n = 0

    def mine(self) -> bool:
        """Whether the next variant belongs to this process (--warm-only shards; every one when timing)."""
        self._n += 1
        return not self.warm_only or (self._n - 1) % self.shard[1] == self.shard[0]

    def time(self, case: str, variant: str, launch: Callable[[int], torch.Tensor], ref: torch.Tensor, nbytes: float):
        if not self.mine():
            return
        err = rel(launch(0), ref)
        if self.warm_only:
            return
        us = chain_us(launch, self.layers, self.reps)
        row = dict(case=case, variant=variant, us=round(us, 2), gbs=round(nbytes / us / 1e3), rel_err=f"{err:.1e}")
        self.rows.append(row)
        print(f"{case:22s} {short(variant):60s} {us:7.2f} us {row['gbs']:5d} GB/s err {err:.0e}", flush=True)

    def best(self, case: str) -> dict:
        return min((r for r in self.rows if r["case"] == case), key=lambda r: r["us"])


def sweep_gemv(sw: Sweep) -> None:
    for (n, k), table in GEMV_FP8_TILE_VARIANTS.items():
        if (n, k) not in GEMV_EXTRA:
            continue
        ws = [q8(torch.randn(n, k, device=DEV) * k**-0.5) for _ in range(sw.layers)]
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        ref = fp8.fp8_linear_dequant_ref(x, ws[0][0], ws[0][1], ws[0][1])
        for t in dict.fromkeys(table + GEMV_EXTRA[(n, k)]):
            sw.time(
                f"gemv {n}x{k}",
                str(t),
                lambda i, t=t, x=x, ws=ws: gemv(x, ws[i][0], None, t, sw.counters, weight_scale=ws[i][1]),
                ref,
                n * k,
            )


class MoeInputs:
    """One expert stack (E experts) and `layers` shared experts; layer i routes to experts 6i..6i+5 (mod E: no
    expert repeats within 21 layers) with weights w."""

    def __init__(self, layers: int, dtype: torch.dtype):
        self.is_fp8 = dtype == FP8_DTYPE
        up, down = torch.randn(E, INTER, D, device=DEV) * D**-0.5, torch.randn(E, D, INTER, device=DEV) * INTER**-0.5
        self.up_s = (up.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        self.down_s = (down.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        if self.is_fp8:
            self.up = (up / self.up_s[:, None, None]).to(FP8_DTYPE)
            self.down = (down / self.down_s[:, None, None]).to(FP8_DTYPE)
        else:
            self.up, self.down = up.to(BF16), down.to(BF16)
        del up, down
        one = torch.ones((), device=DEV)
        self.shared = []
        for _ in range(layers):
            su, sd = torch.randn(SHARED, D, device=DEV) * D**-0.5, torch.randn(D, SHARED, device=DEV) * SHARED**-0.5
            if self.is_fp8:
                (su8, sus), (sd8, sds) = q8(su), q8(sd)
                self.shared.append(dict(shared_up=Fp8Linear(su8, sus, one), shared_down=Fp8Linear(sd8, sds, one)))
            else:
                self.shared.append(dict(shared_up=su.to(BF16), shared_down=sd.to(BF16)))
        self.ids = [((torch.arange(TOPK, device=DEV) + TOPK * i) % E).reshape(1, TOPK) for i in range(layers)]
        self.w = torch.rand(1, TOPK, device=DEV)
        self.x = torch.randn(1, D, device=DEV, dtype=BF16)
        self.scales = Fp8ExpertScales(self.up_s, self.down_s, one.reshape(1), one.reshape(1)) if self.is_fp8 else None
        self.nbytes = (TOPK * 2 * INTER * D + 2 * SHARED * D) * (1 if self.is_fp8 else 2)

    def ref(self) -> torch.Tensor:
        if self.is_fp8:
            one = torch.ones((), device=DEV)
            args = (self.x, self.up, self.down, self.up_s, self.down_s, one, one, self.w, self.ids[0])
            return fp8.fp8_moe_experts_ref(*args, **self.shared[0])
        return moe.moe_experts_ref(self.x, self.up, self.down, self.w, self.ids[0], **self.shared[0])

    def op(self, i: int, up: X | None, down: X | None, counters: torch.Tensor | None) -> torch.Tensor:
        return moe_experts_gemv(
            self.x,
            self.up,
            self.down,
            self.w,
            self.ids[i],
            up,
            down_tiles=down,
            scales=self.scales,
            counters=counters,
            **self.shared[i],
        )

    def pass_args(self, i: int) -> tuple:
        """(ids [k], shared up, shared down, shared scales up / down) of layer i as the passes take them."""
        sh = self.shared[i]
        if self.is_fp8:
            u, d = sh["shared_up"], sh["shared_down"]
            return self.ids[i].reshape(-1), u.weight, d.weight, u.weight_scale, d.weight_scale
        return self.ids[i].reshape(-1), sh["shared_up"], sh["shared_down"], None, None


def sweep_moe(sw: Sweep, only: set[str]) -> None:
    m = MoeInputs(sw.layers, FP8_DTYPE)
    ref = m.ref()
    tiles_ref = X(64, 128, 4, mma=4)
    h0 = expert_up_pass(m.x, m.up, m.ids[0].reshape(-1), TOPK, tiles_ref, m.pass_args(0)[1], m.up_s, m.pass_args(0)[3])
    wf = m.w.reshape(-1).contiguous()
    up_bytes, down_bytes = m.nbytes / 2, m.nbytes / 2
    if "up" in only:
        for t in EXPERT_SWEEP:

            def up(i, t=t):
                ids, su, _, sus, _ = m.pass_args(i)
                return expert_up_pass(m.x, m.up, ids, TOPK, t, su, m.up_s, sus)

            sw.time("fp8 experts up pass", str(t), up, h0, up_bytes)
    if "down" in only:
        y0 = expert_down_pass(
            h0, m.down, m.ids[0].reshape(-1), wf, TOPK, tiles_ref, m.pass_args(0)[2], m.down_s, m.pass_args(0)[4]
        )
        for t in DOWN_SWEEP:

            def down(i, t=t):
                ids, _, sd, _, sds = m.pass_args(i)
                return expert_down_pass(h0, m.down, ids, wf, TOPK, t, sd, m.down_s, sds)

            sw.time("fp8 experts down pass", str(t), down, y0, down_bytes)
    if "moe" in only:
        pairs = list(EXPERT_GEMV_FP8_TILE_VARIANTS)
        if not sw.warm_only and "up" in only and "down" in only:
            best = (_tiles(sw.best("fp8 experts up pass")), _tiles(sw.best("fp8 experts down pass")))
            pairs.append(best)
        for up_t, down_t in dict.fromkeys(pairs):
            for cnt in (None, sw.counters):
                tag = f"up {up_t} down {down_t} {'sum in down' if cnt is not None else 'sum_slots'}"
                sw.time("fp8 moe T=1", tag, lambda i, u=up_t, d=down_t, c=cnt: m.op(i, u, d, c), ref, m.nbytes)
    if "moe" in only:
        b = MoeInputs(sw.layers, BF16)
        ref = b.ref()
        for down_t, cnt in ((None, None), (None, sw.counters), (X(shared_chunks=2), sw.counters)):
            tag = f"default, down {down_t}, {'sum in down' if cnt is not None else 'sum_slots'}"
            sw.time("bf16 moe T=1", tag, lambda i, d=down_t, c=cnt: b.op(i, None, d, c), ref, b.nbytes)


_TILES_BY_NAME = {str(t): t for t in EXPERT_SWEEP + DOWN_SWEEP}


def _tiles(row: dict) -> X:
    return _TILES_BY_NAME[row["variant"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gemv,up,down,moe")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm-only", action="store_true", help="compile this shard's variants, no timing")
    ap.add_argument("--shard", default="0/1", help="i/n: with --warm-only, every n-th variant from the i-th")
    ap.add_argument("--out", default="", help="write the rows and each case's best as JSON here")
    args = ap.parse_args()
    only = set(args.only.split(","))
    i, n = (int(v) for v in args.shard.split("/"))
    sw = Sweep(args.layers, args.reps, args.warm_only, (i, n))
    if "gemv" in only:
        sweep_gemv(sw)
    if only & {"up", "down", "moe"}:
        sweep_moe(sw, only)
    if args.warm_only:
        return
    cases = dict.fromkeys(r["case"] for r in sw.rows)
    best = {c: sw.best(c) for c in cases}
    print("\n## best per case (first row of each case = its current default)")
    for c, r in best.items():
        first = next(x for x in sw.rows if x["case"] == c)
        print(f"{c:22s} {short(r['variant']):60s} {r['us']:7.2f} us ({r['gbs']} GB/s); first {first['us']:.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": sw.rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
