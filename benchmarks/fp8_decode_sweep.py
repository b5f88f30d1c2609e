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
CPU smoke run: TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/fp8_decode_sweep.py --tiny --layers 2 --out s.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.kernels import fp8
from service.engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Linear
from service.engine.kernels.tiles import EXPERT_GEMV_FP8_TILE_VARIANTS, GEMV_FP8_TILE_VARIANTS, ExpertGemvTiles
from service.engine.kernels.tiles import GemvTiles as G
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe import Fp8ExpertScales
from service.engine.kernels.triton_moe_gemv import expert_down_pass, expert_up_pass, moe_experts_gemv

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


@dataclass(frozen=True)
class Plan:
    """What one sweep runs: the device, the MoE layer's shapes, x's dtype and the launch shapes of each case."""

    device: str
    experts: int  # E
    top_k: int
    hidden: int  # d
    inter: int  # I, a routed expert's intermediate size
    shared: int  # S, the shared expert's
    dtype: torch.dtype  # x's
    gemv: dict[tuple[int, int], tuple[G, ...]] = field(hash=False)  # (N, K) -> launch shapes, the first the default
    up: tuple[X, ...] = ()  # the up pass's launch shapes
    down: tuple[X, ...] = ()  # the down pass's
    pairs: tuple[tuple[X, X], ...] = ()  # (up, down) pairs of the whole op, the first the default


def nano_plan() -> Plan:
    gemv_shapes = {shape: GEMV_FP8_TILE_VARIANTS[shape][:1] + extra for shape, extra in GEMV_EXTRA.items()}
    return Plan(
        "cuda",
        128,
        6,
        2688,
        1856,
        3712,
        torch.bfloat16,
        gemv_shapes,
        UP_SWEEP,
        DOWN_SWEEP,
        EXPERT_GEMV_FP8_TILE_VARIANTS,
    )


def tiny_plan() -> Plan:
    """Shrunken shapes, two or three launch shapes per case (FMA, split-K, tensor cores, shared-expert chunks) for
    the CPU interpreter (fp32 x: its bf16 dots are off)."""
    mma, fma = X(16, 32, 4, mma=2), X(4, 32, 2, 1)
    gemv_shapes = {(40, 64): (G(4, 32, 2), G(8, 32, 2, False, 2), G(16, 32, 4, mma=2))}
    down = (dataclasses.replace(mma, shared_chunks=2), fma)
    return Plan("cpu", 8, 2, 64, 48, 96, torch.float32, gemv_shapes, (mma, fma), down, ((mma, down[0]),))


def q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 weight, fp32 per-tensor scale [1])."""
    s = (w.abs().amax() / FP8_MAX).float().reshape(1)
    return (w / s).to(FP8_DTYPE), s


def chain_us(launch: Callable[[int], object], layers: int, reps: int, device: str) -> float:
    """launch(i) for i < layers captured in one CUDA graph (after an eager pass that compiles), replayed reps times:
    the median device us per launch. On the CPU (--tiny): the eager launches' median wall us, which only shows that
    each variant runs."""
    if device == "cpu":
        walls = []
        for i in range(layers):
            t0 = time.perf_counter()
            launch(i)
            walls.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(walls)
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

    def __init__(self, plan: Plan, layers: int, reps: int, warm_only: bool, shard: tuple[int, int]):
        self.plan, self.layers, self.reps = plan, (1 if warm_only else layers), reps
        self.warm_only, self.shard = warm_only, shard
        self.rows: list[dict] = []
        self.launches: dict[tuple[str, str], Callable[[int], torch.Tensor]] = {}
        self.counters = torch.zeros(1 << 16, dtype=torch.int32, device=plan.device)  # split-K GEMVs, as the bundle's
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
        us = chain_us(launch, self.layers, self.reps, self.plan.device)
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
            us2 = chain_us(self.launches[(case, r["variant"])], self.layers, self.reps, self.plan.device)
            r["us2"] = round(us2, 2)
            r["us_mean"] = round((r["us"] + r["us2"]) / 2, 2)
            print(f"{case:22s} {short(r['variant']):60s} again {r['us2']:7.2f} us, mean {r['us_mean']:.2f}")

    def best(self, case: str) -> dict:
        rows = [r for r in self.rows if r["case"] == case]
        confirmed = [r for r in rows if "us_mean" in r]
        return min(confirmed, key=lambda r: r["us_mean"]) if confirmed else min(rows, key=lambda r: r["us"])


def sweep_gemv(sw: Sweep) -> None:
    dev = sw.plan.device
    for (n, k), variants in sw.plan.gemv.items():
        ws = [q8(torch.randn(n, k, device=dev) * k**-0.5) for _ in range(sw.layers)]
        x = torch.randn(1, k, device=dev, dtype=sw.plan.dtype)
        ref = fp8.fp8_linear_dequant_ref(x, ws[0][0], ws[0][1], ws[0][1])
        for t in dict.fromkeys(variants):
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
    k*i .. k*i + k - 1 (mod E: no expert repeats within E / k layers) with weights w."""

    def __init__(self, plan: Plan, layers: int):
        E, k, d, inter, S, dev = plan.experts, plan.top_k, plan.hidden, plan.inter, plan.shared, plan.device
        up, down = torch.randn(E, inter, d, device=dev) * d**-0.5, torch.randn(E, d, inter, device=dev) * inter**-0.5
        self.up_s = (up.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        self.down_s = (down.abs().amax(dim=(1, 2)) / FP8_MAX).float()
        self.up = (up / self.up_s[:, None, None]).to(FP8_DTYPE)
        self.down = (down / self.down_s[:, None, None]).to(FP8_DTYPE)
        del up, down
        one = torch.ones((), device=dev)
        self.shared = []
        for _ in range(layers):
            su, sus = q8(torch.randn(S, d, device=dev) * d**-0.5)
            sd, sds = q8(torch.randn(d, S, device=dev) * S**-0.5)
            self.shared.append(dict(shared_up=Fp8Linear(su, sus, one), shared_down=Fp8Linear(sd, sds, one)))
        self.ids = [((torch.arange(k, device=dev) + k * i) % E).reshape(1, k) for i in range(layers)]
        self.w = torch.rand(1, k, device=dev)
        self.x = torch.randn(1, d, device=dev, dtype=plan.dtype)
        self.scales = Fp8ExpertScales(self.up_s, self.down_s, one.reshape(1), one.reshape(1))
        self.nbytes = k * 2 * inter * d + 2 * S * d

    def ref(self) -> torch.Tensor:
        one = torch.ones((), device=self.x.device)
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
    p = sw.plan
    m = MoeInputs(p, sw.layers)
    ref = m.ref()
    ids0, su0, sd0, sus0, sds0 = m.pass_args(0)
    h0 = expert_up_pass(m.x, m.up, ids0, p.top_k, p.up[0], su0, m.up_s, sus0)
    wf = m.w.reshape(-1).contiguous()
    tiles = {str(t): t for t in p.up + p.down}
    if "up" in only:

        def valid(h: torch.Tensor) -> torch.Tensor:  # the routed rows' I columns, the shared row's S (rest unset)
            return torch.cat([h[: p.top_k, : p.inter].flatten(), h[p.top_k, : p.shared]])

        for t in p.up:

            def up(i, t=t):
                ids, su, _, sus, _ = m.pass_args(i)
                return expert_up_pass(m.x, m.up, ids, p.top_k, t, su, m.up_s, sus)

            sw.time("fp8 experts up pass", str(t), up, h0, m.nbytes / 2, valid)
        sw.confirm("fp8 experts up pass")
    if "down" in only:
        y0 = expert_down_pass(h0, m.down, ids0, wf, p.top_k, p.down[0], sd0, m.down_s, sds0)
        for t in p.down:

            def down(i, t=t):
                ids, _, sd, _, sds = m.pass_args(i)
                return expert_down_pass(h0, m.down, ids, wf, p.top_k, t, sd, m.down_s, sds)

            sw.time("fp8 experts down pass", str(t), down, y0, m.nbytes / 2)
        sw.confirm("fp8 experts down pass")
    if "moe" in only:
        pairs = list(p.pairs)
        if not sw.warm_only and "up" in only and "down" in only:
            best_up, best_down = sw.best("fp8 experts up pass"), sw.best("fp8 experts down pass")
            pairs.append((tiles[best_up["variant"]], tiles[best_down["variant"]]))
        for up_t, down_t in dict.fromkeys(pairs):
            sw.time("fp8 moe T=1", f"up {up_t} down {down_t}", lambda i, u=up_t, d=down_t: m.op(i, u, d), ref, m.nbytes)
        sw.confirm("fp8 moe T=1", top=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="gemv,up,down,moe")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warm-only", action="store_true", help="compile this shard's variants, no timing")
    ap.add_argument("--shard", default="0/1", help="i/n: with --warm-only, every n-th variant from the i-th")
    ap.add_argument("--out", default="", help="write the rows and each case's best as JSON here")
    ap.add_argument("--tiny", action="store_true", help="shrunken shapes on the CPU (TRITON_INTERPRET=1): a smoke test")
    args = ap.parse_args()
    only = set(args.only.split(","))
    i, n = (int(v) for v in args.shard.split("/"))
    sw = Sweep(tiny_plan() if args.tiny else nano_plan(), args.layers, args.reps, args.warm_only, (i, n))
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
