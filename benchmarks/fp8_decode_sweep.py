"""The batch-1 FP8 decode kernels timed as a decode step runs them: CUDA-graph chains of PDL launches, each launch on
its own weights.

A batch-1 launch lasts ~5-30 us, so one launch timed alone (do_bench) mostly reads its host overhead. Here every
case is a chain of --layers launches, each on a distinct weight set (the chain is far above L2, as a decode step's
layers are), captured in one CUDA graph and replayed back to back (CUDA events, median of --reps replays): device us
per launch and the weight GB/s it reaches, with the launch ramps and PDL overlaps of a real step. Cases (Nano-30B-A3B):
- `gemv`: the FP8 GEMV (`triton_gemv.gemv`, weight-only) at the FP8 linear shapes (mamba in_proj 10304 x 2688,
  out_proj 2688 x 4096): each shape's default (the first of `GEMV_FP8_TILE_VARIANTS`) and GEMV_EXTRA.
- `up` / `down`: one pass of the batch-1 MoE layer's FP8 grouped GEMVs (top-6 routed + the shared expert as a 7th
  slot) over UP_SWEEP / DOWN_SWEEP (the down pass includes the slot sum; most tiles with the shared expert's K in two
  chunks); `moe`: the whole op for the tile pairs of `EXPERT_GEMV_FP8_TILE_VARIANTS` and the best up / down pair.
Each row carries the relative error of its first launch against the torch reference; each case's default and fastest
rows are timed a second time (`Sweep.confirm`) and the mean of the two picks the best. --warm-only compiles the
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

from service.engine.kernels import fp8
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear
from service.engine.kernels.tiles import EXPERT_GEMV_FP8_TILE_VARIANTS, GEMV_FP8_TILE_VARIANTS, ExpertGemvTiles
from service.engine.kernels.tiles import GemvTiles as G
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import Fp8ExpertScales
from service.engine.kernels.triton_moe_gemv import expert_down_pass, expert_up_pass, moe_experts_gemv

DEV, BF16 = "cuda", torch.bfloat16
E, TOPK, D, INTER, SHARED = 128, 6, 2688, 1856, 3712
X = ExpertGemvTiles
# launch shapes timed beside each shape's default (the first of its GEMV_FP8_TILE_VARIANTS); the FMA tiles without
# the register prefetch led the first round (tensor-core and split-K tiles were slower at both shapes)
GEMV_EXTRA = {
    (10304, 2688): (
        G(8, 512, 4),
        G(4, 256, 4, False),
        G(8, 256, 2, False),
        G(16, 256, 8, False),
        G(8, 128, 4, False),
        G(16, 128, 4, False),
        G(4, 512, 4, False),
        G(16, 256, 4, False),
        G(8, 256, 8, False),
        G(4, 256, 2, False),
        G(8, 256, 4, False, 2),
    ),
    (2688, 4096): (
        G(4, 1024, 4),
        G(8, 512, 4, False),
        G(4, 1024, 4, False),
        G(16, 1024, 8, False),
        G(8, 1024, 8, False),
        G(8, 2048, 8, False),
        G(8, 256, 4, False),
        G(16, 512, 8, False),
        G(8, 1024, 4, False, 2),
        G(4, 1024, 2, False),
    ),
}
# FMA tiles without the register prefetch (depth 1), after tensor-core tiles around the defaults
_FMA = (X(8, 256, 4, 1), X(4, 256, 4, 1), X(8, 256, 2, 1), X(16, 256, 8, 1), X(8, 512, 4, 1), X(8, 128, 4, 1))
UP_SWEEP = (
    X(128, 128, 8, mma=4),
    X(64, 128, 4, mma=4),
    X(128, 128, 8, mma=5),
    X(128, 128, 8, mma=6),
    X(128, 256, 8, mma=3),
    X(64, 128, 4, mma=3),
    X(32, 128, 4, mma=3),
    X(4, 512, 4, 1),
) + _FMA
# the down pass with the shared expert in two K chunks (the first: as one unit, the former default)
DOWN_SWEEP = (X(64, 128, 4, mma=3, shared_chunks=2), X(64, 128, 4, mma=4)) + tuple(
    dataclasses.replace(t, shared_chunks=2)
    for t in (
        X(64, 128, 4, mma=2),
        X(32, 128, 4, mma=3),
        X(64, 64, 4, mma=4),
        X(64, 64, 4, mma=6),
        X(128, 128, 8, mma=3),
        X(32, 64, 4, mma=4),
    )
    + _FMA
)


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
    """Inputs of `layers` layers and the rows timed so far (each: case, variant, us, GB/s, rel err; after `confirm`
    also us2, the same chain timed again, and us_mean)."""

    def __init__(self, layers: int, reps: int, warm_only: bool, shard: tuple[int, int]):
        self.layers, self.reps, self.warm_only, self.shard = (1 if warm_only else layers), reps, warm_only, shard
        self.rows: list[dict] = []
        self.launches: dict[tuple[str, str], Callable[[int], torch.Tensor]] = {}
        self.counters = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)  # split-K GEMVs, as the bundle's
        self._n = 0

    def mine(self) -> bool:
        """Whether the next variant belongs to this process (--warm-only shards; every one when timing)."""
        self._n += 1
        return not self.warm_only or (self._n - 1) % self.shard[1] == self.shard[0]

    def time(
        self,
        case: str,
        variant: str,
        launch: Callable[[int], torch.Tensor],
        ref: torch.Tensor,
        nbytes: float,
        view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    ) -> None:
        """Times launch's chain (view: the part of its output and of ref that the error compares)."""
        if not self.mine():
            return
        err = rel(view(launch(0)), view(ref))
        if self.warm_only:
            return
        us = chain_us(launch, self.layers, self.reps)
        row = dict(case=case, variant=variant, us=round(us, 2), gbs=round(nbytes / us / 1e3), rel_err=f"{err:.1e}")
        row["nbytes"] = nbytes
        self.rows.append(row)
        self.launches[(case, variant)] = launch
        print(f"{case:22s} {short(variant):60s} {us:7.2f} us {row['gbs']:5d} GB/s err {err:.0e}", flush=True)

    def confirm(self, case: str, top: int = 3) -> None:
        """Times the case's first row (its default) and its `top` fastest once more; their us_mean decides `best`."""
        rows = [r for r in self.rows if r["case"] == case]
        if self.warm_only or not rows:
            return
        for r in dict((id(r), r) for r in rows[:1] + sorted(rows, key=lambda r: r["us"])[:top]).values():
            r["us2"] = round(chain_us(self.launches[(case, r["variant"])], self.layers, self.reps), 2)
            r["us_mean"] = round((r["us"] + r["us2"]) / 2, 2)
            print(f"{case:22s} {short(r['variant']):60s} again {r['us2']:7.2f} us, mean {r['us_mean']:.2f}")

    def best(self, case: str) -> dict:
        rows = [r for r in self.rows if r["case"] == case]
        confirmed = [r for r in rows if "us_mean" in r]
        return min(confirmed, key=lambda r: r["us_mean"]) if confirmed else min(rows, key=lambda r: r["us"])


def sweep_gemv(sw: Sweep) -> None:
    for (n, k), table in GEMV_FP8_TILE_VARIANTS.items():
        if (n, k) not in GEMV_EXTRA:
            continue
        ws = [q8(torch.randn(n, k, device=DEV) * k**-0.5) for _ in range(sw.layers)]
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        ref = fp8.fp8_linear_dequant_ref(x, ws[0][0], ws[0][1], ws[0][1])
        for t in dict.fromkeys(table[:1] + GEMV_EXTRA[(n, k)]):
            sw.time(
                f"gemv {n}x{k}",
                str(t),
                lambda i, t=t, x=x, ws=ws: gemv(x, ws[i][0], None, t, sw.counters, weight_scale=ws[i][1]),
                ref,
                n * k,
            )
        sw.confirm(f"gemv {n}x{k}")


class MoeInputs:
    """One FP8 expert stack (E experts, per-expert scales) and `layers` FP8 shared experts; layer i routes to experts
    6i..6i+5 (mod E: no expert repeats within 21 layers) with weights w."""

    def __init__(self, layers: int):
        up, down = torch.randn(E, INTER, D, device=DEV) * D**-0.5, torch.randn(E, D, INTER, device=DEV) * INTER**-0.5
        self.up_s = (up.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        self.down_s = (down.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        self.up = (up / self.up_s[:, None, None]).to(FP8_DTYPE)
        self.down = (down / self.down_s[:, None, None]).to(FP8_DTYPE)
        del up, down
        one = torch.ones((), device=DEV)
        self.shared = []
        for _ in range(layers):
            (su8, sus), (sd8, sds) = (
                q8(torch.randn(SHARED, D, device=DEV) * D**-0.5),
                q8(torch.randn(D, SHARED, device=DEV) * SHARED**-0.5),
            )
            self.shared.append(dict(shared_up=Fp8Linear(su8, sus, one), shared_down=Fp8Linear(sd8, sds, one)))
        self.ids = [((torch.arange(TOPK, device=DEV) + TOPK * i) % E).reshape(1, TOPK) for i in range(layers)]
        self.w = torch.rand(1, TOPK, device=DEV)
        self.x = torch.randn(1, D, device=DEV, dtype=BF16)
        self.scales = Fp8ExpertScales(self.up_s, self.down_s, one.reshape(1), one.reshape(1))
        self.nbytes = TOPK * 2 * INTER * D + 2 * SHARED * D

    def ref(self) -> torch.Tensor:
        one = torch.ones((), device=DEV)
        args = (self.x, self.up, self.down, self.up_s, self.down_s, one, one, self.w, self.ids[0])
        return fp8.fp8_moe_experts_ref(*args, **self.shared[0])

    def op(self, i: int, up: X | None, down: X | None) -> torch.Tensor:
        return moe_experts_gemv(
            self.x, self.up, self.down, self.w, self.ids[i], up, down_tiles=down, scales=self.scales, **self.shared[i]
        )

    def pass_args(self, i: int) -> tuple:
        """(ids [k], shared up, shared down, their weight scales) of layer i as the passes take them."""
        u, d = self.shared[i]["shared_up"], self.shared[i]["shared_down"]
        return self.ids[i].reshape(-1), u.weight, d.weight, u.weight_scale, d.weight_scale


def sweep_moe(sw: Sweep, only: set[str]) -> None:
    m = MoeInputs(sw.layers)
    ref = m.ref()
    tiles_ref = X(64, 128, 4, mma=4)
    h0 = expert_up_pass(m.x, m.up, m.ids[0].reshape(-1), TOPK, tiles_ref, m.pass_args(0)[1], m.up_s, m.pass_args(0)[3])
    wf = m.w.reshape(-1).contiguous()
    up_bytes, down_bytes = m.nbytes / 2, m.nbytes / 2
    if "up" in only:

        def valid(h: torch.Tensor) -> torch.Tensor:  # the routed rows' I columns, the shared row's S (rest unset)
            return torch.cat([h[:TOPK, :INTER].flatten(), h[TOPK, :SHARED]])

        for t in UP_SWEEP:

            def up(i, t=t):
                ids, su, _, sus, _ = m.pass_args(i)
                return expert_up_pass(m.x, m.up, ids, TOPK, t, su, m.up_s, sus)

            sw.time("fp8 experts up pass", str(t), up, h0, up_bytes, valid)
        sw.confirm("fp8 experts up pass")
    if "down" in only:
        y0 = expert_down_pass(
            h0, m.down, m.ids[0].reshape(-1), wf, TOPK, tiles_ref, m.pass_args(0)[2], m.down_s, m.pass_args(0)[4]
        )
        for t in DOWN_SWEEP:

            def down(i, t=t):
                ids, _, sd, _, sds = m.pass_args(i)
                return expert_down_pass(h0, m.down, ids, wf, TOPK, t, sd, m.down_s, sds)

            sw.time("fp8 experts down pass", str(t), down, y0, down_bytes)
        sw.confirm("fp8 experts down pass")
    if "moe" in only:
        pairs = list(EXPERT_GEMV_FP8_TILE_VARIANTS)
        if not sw.warm_only and "up" in only and "down" in only:
            pairs.append((_tiles(sw.best("fp8 experts up pass")), _tiles(sw.best("fp8 experts down pass"))))
        for up_t, down_t in dict.fromkeys(pairs):
            sw.time("fp8 moe T=1", f"up {up_t} down {down_t}", lambda i, u=up_t, d=down_t: m.op(i, u, d), ref, m.nbytes)
        sw.confirm("fp8 moe T=1", top=2)


_TILES_BY_NAME = {str(t): t for t in UP_SWEEP + DOWN_SWEEP}


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
        us, first_us = r.get("us_mean", r["us"]), first.get("us_mean", first["us"])
        gbs = round(r["nbytes"] / us / 1e3)
        print(f"{c:22s} {short(r['variant']):60s} {us:7.2f} us ({gbs} GB/s); default {first_us:.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": sw.rows, "best": best}, f, indent=1)


if __name__ == "__main__":
    main()
