"""Launch-shape sweeps of the batch-1 decode GEMVs, run by benchmarks/kernels.py (`--only gemv,moe_tune`).

`gemv`: the single-row `triton_gemv.gemv` at the Nano-30B-A3B decode shapes (N, K), each over ~10 GemvTiles (block
sizes, warps, register prefetch, split-K) against its `default_gemv_tiles` (what `linear` runs) and cuBLAS. Where
the GEMV has no split, three "proxy" rows run the same product through the expert up kernel (`expert_up_pass` with
one expert, k = 1: a single-row GEMV with a ReLU² epilogue) at the default's tile: depth 2 (its calibration
against the real kernel), depth 3 and Triton's loop pipeline, the knobs `gemv`'s own loop does not have.
`moe_tune`: the batch-1 MoE layer as the engine calls it (T = 1, top-6 routed + the shared expert as a 7th slot),
its up and down passes (the down pass with its slot sum) timed apart over ~40 ExpertGemvTiles (block sizes, warps,
register prefetch depth 1-4, Triton's loop pipeline), then the whole op with the best pass tiles against the default.

Each row: do_bench median (CUDA events; do_bench zeroes 256 MB between calls and the inputs rotate over several
sets, so the weights come from HBM), GB/s over the fewest bytes the op must move, % of the measured copy bandwidth,
speedup over the case's default, and the relative error against the torch reference (a broken variant shows).
Stage-pipelined variants (new code paths) run after all others, so a GPU fault there costs only them; a fault that
breaks the CUDA context stops the sweep and the summary covers what ran. The summary re-times each case's default
and its best variants once more. `tiny=True` shrinks every shape and variant list for the CPU interpreter.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from service.engine.config import ModelConfig
from service.engine.kernels import moe
from service.engine.kernels.tiles import ExpertGemvTiles, GemvTiles, default_gemv_tiles
from service.engine.kernels.triton_gemv import gemv
from service.engine.kernels.triton_moe_gemv import (
    expert_down_pass,
    expert_up_pass,
    moe_experts_by_size,
    moe_experts_gemv,
    moe_experts_tiled_shared,
)

NANO_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "tests",
    "engine",
    "fixtures",
    "nano_30b_a3b_config.json",
)
L2_BYTES = 60e6
G, X = GemvTiles, ExpertGemvTiles

# ---------------- variant lists (first of each = what the sweep compares against after the default) -------------
GEMV_LONG_K = (
    G(4, 512, 4),
    G(4, 512, 2),
    G(4, 512, 8),
    G(2, 1024, 4),
    G(4, 1024, 4),
    G(8, 512, 4),
    G(8, 256, 4),
    G(2, 512, 2),
    G(4, 512, 4, False),
    G(4, 512, 4, True, 2),
    G(8, 512, 4, True, 2),
)  # K 4096
GEMV_SHORT_K = (
    G(4, 512, 4),
    G(8, 256, 4),
    G(4, 512, 2),
    G(2, 1024, 4),
    G(16, 128, 4),
    G(8, 128, 2),
    G(4, 256, 2),
    G(8, 256, 8),
    G(4, 512, 4, False),
    G(4, 512, 4, True, 2),
    G(8, 256, 4, True, 2),
)  # K 2688, N 4-5K
GEMV_WIDE = (
    G(8, 256, 4),
    G(4, 512, 4),
    G(16, 128, 4),
    G(16, 256, 8),
    G(8, 256, 2),
    G(4, 512, 2),
    G(32, 128, 8),
    G(8, 512, 4),
    G(8, 128, 2),
    G(8, 256, 4, False),
    G(4, 1024, 4, False),
)  # in_proj
GEMV_NARROW = (
    G(8, 256, 4, True, 1),
    G(8, 256, 4, True, 2),
    G(8, 128, 4, True, 7),
    G(4, 256, 4, True, 4),
    G(4, 512, 4, True, 2),
    G(4, 256, 2, True, 4),
    G(2, 512, 2, True, 2),
    G(16, 128, 4, True, 4),
    G(4, 128, 2, True, 7),
    G(8, 256, 4, False, 4),
)  # k / v: N 256
GEMV_LM_HEAD = (G(8, 256, 4), G(16, 256, 8), G(4, 512, 4), G(16, 128, 4), G(32, 128, 8))
EXPERT_SWEEP = (
    # tile shape, depth 2 (the current loop)
    X(2, 512, 4),
    X(2, 1024, 4),
    X(4, 256, 4),
    X(4, 1024, 4),
    X(8, 256, 4),
    X(8, 512, 4),
    X(16, 128, 4),
    X(16, 64, 4),
    X(16, 256, 8),
    # warps: elements (16-byte vectors) per thread per tile
    X(4, 512, 2),
    X(4, 512, 8),
    X(2, 512, 2),
    X(4, 256, 2),
    X(8, 256, 2),
    X(8, 512, 8),
    # weight tiles in flight in registers: depth 1, 3, 4
    X(4, 512, 4, 1),
    X(4, 512, 4, 3),
    X(4, 512, 4, 4),
    X(8, 256, 4, 3),
    X(8, 256, 4, 4),
    X(4, 256, 4, 3),
    X(4, 256, 4, 4),
    X(4, 256, 2, 3),
    X(2, 512, 2, 3),
    X(4, 512, 2, 3),
    X(2, 1024, 4, 3),
    X(8, 128, 4, 4),
    X(16, 64, 4, 4),
    # Triton's loop pipeline (loads through shared memory), depth 1
    X(4, 512, 4, 1, 2),
    X(4, 512, 4, 1, 3),
    X(4, 512, 4, 1, 4),
    X(8, 256, 4, 1, 3),
    X(8, 256, 4, 1, 4),
    X(4, 256, 4, 1, 4),
    X(8, 512, 4, 1, 3),
    X(16, 256, 8, 1, 3),
    X(4, 256, 2, 1, 4),
    X(2, 512, 2, 1, 4),
)
TINY_GEMV_ALT = G(4, 32, 2, True, 2)
TINY_EXPERT_SWEEP = (X(8, 32, 2, 3),)
TINY_PROXIES = (X(8, 32, 2, 3), X(4, 32, 2, 1, 2))


@dataclass(frozen=True)
class Shapes:
    """The GEMV shapes (name, N, K) and the MoE layer (E, top_k, d, I, S) a sweep runs."""

    gemv: tuple[tuple[str, int, int], ...]
    experts: int
    top_k: int
    hidden: int
    inter: int
    shared: int


def nano_shapes(path: str = NANO_CONFIG) -> Shapes:
    """From the repo's Nano-30B-A3B config: out_proj/o_proj (2688, 4096), q (4096, 2688), k/v (256, 2688), fused
    q+k+v (4608, 2688), in_proj (2 * 4096 + 2 * 8 * 128 + 64 = 10304, 2688), lm_head (131072, 2688); MoE E 128,
    top-6, I 1856, S 3712."""
    with open(path, encoding="utf-8") as f:
        c = ModelConfig.from_hf_dict(json.load(f))
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    names = {}
    for name, n, k in (
        ("mamba out_proj", d, c.mamba_intermediate),
        ("attn o_proj", d, q),
        ("attn q_proj", q, d),
        ("attn k_proj / v_proj", kv, d),
        ("attn qkv fused", q + 2 * kv, d),
        ("mamba in_proj", c.in_proj_dim, d),
        ("lm_head", c.vocab_size, d),
    ):
        names.setdefault((n, k), []).append(name)
    return Shapes(
        tuple((" + ".join(v), n, k) for (n, k), v in names.items()),
        c.n_routed_experts,
        c.num_experts_per_tok,
        d,
        c.moe_intermediate_size,
        c.moe_shared_expert_intermediate_size,
    )


TINY = Shapes((("out_proj", 40, 64), ("k_proj", 16, 48)), 4, 2, 48, 24, 40)  # --tiny (interpreter smoke test)


@dataclass
class Variant:
    name: str
    kind: str  # default | tiles | proxy | cublas | ref
    fn: Callable[..., Any]  # timed: fn(*input_set)
    check: Callable[..., float] | None = None  # rel err against the torch reference on one input set
    risky: bool = False  # a new code path: runs after every other variant
    tiles: Any = None


@dataclass
class SweepCase:
    name: str
    bytes_moved: float
    make: Callable[[], tuple]  # one input set
    variants: list[Variant]
    followup: Callable[[dict], list[Variant]] | None = None  # more variants from the results so far
    sets: list[tuple] = field(default_factory=list)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tiles_name(t: Any) -> str:
    if isinstance(t, GemvTiles):
        return (
            f"bn={t.block_n} bk={t.block_k} w={t.warps} {'prefetch' if t.prefetch else 'no-prefetch'} split={t.split_k}"
        )
    return f"bn={t.block_n} bk={t.block_k} w={t.warps} depth={t.depth} stages={t.stages}"


# ---------------- gemv ----------------
def _gemv_variant_list(n: int, k: int, tiny: bool) -> tuple[GemvTiles, ...]:
    if tiny:
        return (TINY_GEMV_ALT,)
    if n <= 512:
        return GEMV_NARROW
    if n >= 65536:
        return GEMV_LM_HEAD
    if n >= 8192:
        return GEMV_WIDE
    return GEMV_LONG_K if k >= 4096 else GEMV_SHORT_K


def gemv_case(name: str, n: int, k: int, device: str, tiny: bool, proxies: bool = True) -> SweepCase:
    """One shape: the default tiles, the others of its list, cuBLAS, and (no split-K default, not lm_head) the
    expert-kernel proxies. Each input set: x [1, K], W [N, K] bf16 (fp32 on the CPU interpreter), persistent
    zeroed split-K counters (the engine passes its own), expert ids 0 for the proxy. proxies False: none (--tiny
    runs them on its first shape only)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16

    def make():
        x = torch.randn(1, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        return x, w, torch.zeros(n, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int64, device=device)

    def ref(x, w):
        return F.linear(x.float(), w.float())

    def gemv_variant(t: GemvTiles, kind: str) -> Variant:
        return Variant(
            tiles_name(t) + (" (default)" if kind == "default" else ""),
            kind,
            lambda x, w, c, _i, t=t: gemv(x, w, None, t, counters=c),
            lambda x, w, c, _i, t=t: rel_err(gemv(x, w, None, t, counters=c), ref(x, w)),
            tiles=t,
        )

    def proxy(t: ExpertGemvTiles) -> Variant:
        def run(x, w, _c, ids, t=t):
            return expert_up_pass(x, w.view(1, n, k), ids, 1, t)

        return Variant(
            f"proxy expert-up kernel {tiles_name(t)}",
            "proxy",
            run,
            lambda x, w, c, ids: rel_err(run(x, w, c, ids), ref(x, w).relu().square()),
            risky=t.stages > 1,
            tiles=t,
        )

    d = default_gemv_tiles(n, k)
    variants = [gemv_variant(d, "default")]
    variants += [gemv_variant(t, "tiles") for t in _gemv_variant_list(n, k, tiny) if t != d]
    variants.append(
        Variant(
            "cuBLAS F.linear",
            "cublas",
            lambda x, w, _c, _i: F.linear(x, w),
            lambda x, w, _c, _i: rel_err(F.linear(x, w), ref(x, w)),
        )
    )
    bn, bk, warps = d.block_n, d.block_k, d.warps
    if tiny and proxies:
        variants += [proxy(t) for t in TINY_PROXIES]
    elif proxies and d.split_k == 1 and n < 65536:
        variants += [
            proxy(X(bn, bk, warps, 2 if d.prefetch else 1)),
            proxy(X(bn, bk, warps, 3)),
            proxy(X(bn, bk, warps, 1, 3)),
        ]
    return SweepCase(f"gemv {name} N={n} K={k}", n * k * 2 + (n + k) * 2, make, variants)


# ---------------- moe_tune ----------------
class _ExpertWeights:
    """The routed experts' up [E, I, d] and down [E, d, I], allocated on first use and shared by the MoE cases."""

    def __init__(self, s: Shapes, device: str, dtype: torch.dtype):
        self.s, self.device, self.dtype, self.w = s, device, dtype, None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w is None:
            s, kw = self.s, dict(device=self.device, dtype=self.dtype)
            self.w = (
                torch.randn(s.experts, s.inter, s.hidden, **kw) * s.hidden**-0.5,
                torch.randn(s.experts, s.hidden, s.inter, **kw) * s.inter**-0.5,
            )
        return self.w


def moe_cases(s: Shapes, device: str, tiny: bool) -> list[SweepCase]:
    """T = 1, top-k routed + the shared expert (the engine's `moe_experts(h, up, down, w, ids, shared_up=,
    shared_down=)`): the up pass and the down pass over the expert sweep (each checked through the whole op with
    the default tiles on the other pass), then the op itself: the engine's default, the tiled path with the shared
    expert as GEMVs (the engine's other choice), and the best up + best down tiles found."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    experts = _ExpertWeights(s, device, dtype)
    routed_rows, slots, d = s.top_k * s.inter + s.shared, s.top_k + 1, s.hidden
    weight_bytes = 2 * routed_rows * d * 2

    def make():
        up, down = experts.get()
        x = torch.randn(1, d, device=device, dtype=dtype)
        ids = torch.randperm(s.experts, device=device)[: s.top_k].view(1, -1)  # distinct experts, int64
        w = torch.rand(1, s.top_k, device=device) + 0.1
        su = torch.randn(s.shared, d, device=device, dtype=dtype) * d**-0.5
        sd = torch.randn(d, s.shared, device=device, dtype=dtype) * s.shared**-0.5
        h = torch.randn(slots, max(s.inter, s.shared), device=device, dtype=dtype).relu().square()
        return x, up, down, w, ids, su, sd, h, ids.reshape(-1).contiguous(), w.reshape(-1).contiguous()

    def ref(x, up, down, w, ids, su, sd, *_):
        return moe.moe_experts_ref(x, up, down, w, ids, shared_up=su, shared_down=sd)

    def op(up_t, down_t):
        def run(x, up, down, w, ids, su, sd, *_):
            return moe_experts_gemv(x, up, down, w, ids, up_t, down_tiles=down_t, shared_up=su, shared_down=sd)

        return run

    def checked(fn):
        return lambda *a: rel_err(fn(*a), ref(*a))

    def up_variant(t: ExpertGemvTiles, kind: str) -> Variant:
        def run(x, up, down, w, ids, su, sd, h, ids_f, w_f, t=t):
            return expert_up_pass(x, up, ids_f, s.top_k, t, su)

        return Variant(
            tiles_name(t) + (" (default)" if kind == "default" else ""), kind, run, checked(op(t, X())), t.stages > 1, t
        )

    def down_variant(t: ExpertGemvTiles, kind: str) -> Variant:
        def run(x, up, down, w, ids, su, sd, h, ids_f, w_f, t=t):
            return expert_down_pass(h, down, ids_f, w_f, s.top_k, t, sd)

        return Variant(
            tiles_name(t) + (" (default)" if kind == "default" else ""), kind, run, checked(op(X(), t)), t.stages > 1, t
        )

    sweep = TINY_EXPERT_SWEEP if tiny else EXPERT_SWEEP
    label = f"T=1 top-{s.top_k} + shared (E {s.experts}, d {d}, I {s.inter}, S {s.shared})"
    up_case = SweepCase(
        f"moe up pass {label}",
        weight_bytes / 2 + d * 2 + routed_rows * 2,
        make,
        [up_variant(X(), "default")] + [up_variant(t, "tiles") for t in sweep],
    )
    down_case = SweepCase(
        f"moe down pass {label}",
        weight_bytes / 2 + routed_rows * 2 + slots * d * 2,
        make,
        [down_variant(X(), "default")] + [down_variant(t, "tiles") for t in sweep],
    )

    def engine_call(x, up, down, w, ids, su, sd, *_):
        return moe_experts_by_size(x, up, down, w, ids, shared_up=su, shared_down=sd)

    def tiled(x, up, down, w, ids, su, sd, *_):
        return moe_experts_tiled_shared(x, up, down, w, ids, shared_up=su, shared_down=sd)

    def best_pair(results: dict) -> list[Variant]:
        best_up, best_down = (_best(results.get(c.name, []), ("default", "tiles")) for c in (up_case, down_case))
        if best_up is None or best_down is None:
            return []
        t_up, t_down = best_up[0].tiles, best_down[0].tiles
        if t_up == X() and t_down == X():
            return []
        fn = op(t_up, t_down)
        return [
            Variant(
                f"moe_experts_gemv up {tiles_name(t_up)} / down {tiles_name(t_down)}",
                "tiles",
                fn,
                checked(fn),
                t_up.stages > 1 or t_down.stages > 1,
                (t_up, t_down),
            )
        ]

    op_case = SweepCase(
        f"moe_experts (the engine's call) {label}",
        weight_bytes + 2 * d * 2,
        make,
        [
            Variant(
                "moe_experts_by_size: grouped GEMVs, default tiles (default)",
                "default",
                engine_call,
                checked(engine_call),
                tiles=(X(), X()),
            ),
            Variant("tiled GEMMs + shared expert GEMVs (tiledmoe)", "ref", tiled, checked(tiled)),
        ],
        best_pair,
    )
    return [up_case, down_case, op_case]


# ---------------- running ----------------
def _best(rows: list, kinds: tuple[str, ...] | None = None):
    ok = [r for r in rows if math.isfinite(r[1]) and (kinds is None or r[0].kind in kinds)]
    return min(ok, key=lambda r: r[1]) if ok else None


def bench_us(fn: Callable, sets: list[tuple], rep: int = 150) -> float:
    """do_bench median in µs (CUDA events; do_bench zeroes 256 MB before each call), cycling the input sets."""
    it = itertools.cycle(sets)
    return 1000 * triton.testing.do_bench(lambda: fn(*next(it)), warmup=25, rep=rep, return_mode="median")


def wall_us(fn: Callable, sets: list[tuple], rep: int = 0) -> float:
    """One call's wall time (CPU interpreter: only shows that the variant runs)."""
    t0 = time.perf_counter()
    fn(*sets[0])
    return (time.perf_counter() - t0) * 1e6


def small_copy_gbs(device: str) -> float:
    """A 16 MB copy (read + write), GB/s: the --tiny stand-in for roofline.copy_gbs."""
    a = torch.randn(2**22, device=device)
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    if device != "cpu":
        torch.cuda.synchronize()
    return 3 * 2 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def _context_ok(device: str) -> bool:
    if device == "cpu":
        return True
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # a sticky CUDA error (e.g. an illegal address): stop the sweep
        return False


HEADER = [
    "| case | variant | µs | GB/s | % copy BW | vs default | rel err |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
]


def run(
    cases: list[SweepCase], copy_gbs: float, device: str, tiny: bool, deadline: float, emit: Callable[[str], None]
) -> tuple[list[str], list[str]]:
    """Times every variant (safe ones first, then the risky ones, then each case's follow-ups), re-times each
    case's default, best and best launch shape, and returns (the rows grouped by case, the summary table)."""
    timer = wall_us if tiny else bench_us
    results: dict[str, list] = {c.name: [] for c in cases}
    lines: dict[str, list[str]] = {c.name: [] for c in cases}
    broken = ""

    def time_variant(case: SweepCase, v: Variant) -> None:
        nonlocal broken
        if broken or time.monotonic() > deadline:
            results[case.name].append((v, math.nan, "skipped: " + (broken or "past --budget-s")))
            return
        try:
            if not case.sets:
                n = 1 if tiny else max(2, min(64, int(4 * L2_BYTES // case.bytes_moved)))
                case.sets = [case.make() for _ in range(n)]
            err = v.check(*case.sets[0]) if v.check else math.nan
            us = timer(v.fn, case.sets)
            results[case.name].append((v, us, f"{err:.1e}"))
        except Exception as e:  # a variant that fails to compile or run: record, go on
            results[case.name].append((v, math.nan, f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            if not _context_ok(device):
                broken = f"CUDA context lost after {case.name} / {v.name}"
        row = _row(case, results[case.name][-1], results[case.name], copy_gbs)
        lines[case.name].append(row)
        emit(row)

    for risky in (False, True):
        for case in cases:
            for v in case.variants:
                if v.risky == risky:
                    time_variant(case, v)
    for case in cases:
        if case.followup is not None:
            for v in case.followup(results):
                case.variants.append(v)
                time_variant(case, v)
    summary = _summary(cases, results, copy_gbs, timer, deadline, broken, tiny)
    for case in cases:
        case.sets.clear()
    if device != "cpu" and not broken:
        torch.cuda.empty_cache()
    return [row for c in cases for row in lines[c.name]], summary


def _row(case: SweepCase, r: tuple, rows: list, copy_gbs: float) -> str:
    v, us, note = r
    default = next((x[1] for x in rows if x[0].kind == "default"), math.nan)
    gbs = case.bytes_moved / us / 1e3 if math.isfinite(us) else math.nan
    return (
        f"| {case.name} | {v.name} | {us:.2f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f}% | {default / us:.3f}x "
        f"| {note} |"
    )


def _summary(cases, results, copy_gbs, timer, deadline, broken, tiny) -> list[str]:
    out = [
        "",
        "Per case: the default against the fastest variant, and the fastest Triton launch shape of the op "
        "itself (kind tiles; cuBLAS and proxy rows are not launch shapes of it). re-timed: one more do_bench of "
        "each after the sweep (same inputs).",
        "",
        "| case | MB | default | µs | % copy BW | best | µs | % copy BW | speedup "
        "| re-timed default / best / shape µs | best launch shape of the op | µs | speedup |",
        "| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: |",
    ]
    for case in cases:
        rows = results[case.name]
        d, b, bt = _best(rows, ("default",)), _best(rows), _best(rows, ("default", "tiles"))
        if d is None or b is None:
            out.append(f"| {case.name} | {case.bytes_moved / 1e6:.1f} | - | - | - | - | - | - | - | - | - | - | - |")
            continue
        retimed = "-"
        if not broken and time.monotonic() < deadline and case.sets:
            try:
                again = {id(x[0]): timer(x[0].fn, case.sets) for x in (d, b, bt)}
                retimed = " / ".join(f"{again[id(x[0])]:.2f}" for x in (d, b, bt))
            except Exception as e:
                retimed = f"error: {type(e).__name__}"

        def pct(us, case=case):
            return 100 * case.bytes_moved / us / 1e3 / copy_gbs

        out.append(
            f"| {case.name} | {case.bytes_moved / 1e6:.1f} | {d[0].name} | {d[1]:.2f} | {pct(d[1]):.1f}% "
            f"| {b[0].name} | {b[1]:.2f} | {pct(b[1]):.1f}% | {d[1] / b[1]:.3f}x | {retimed} "
            f"| {bt[0].name} | {bt[1]:.2f} | {d[1] / bt[1]:.3f}x |"
        )
    if broken:
        out += ["", f"Stopped early: {broken}."]
    if tiny:
        out += ["", "--tiny: shrunken shapes on the interpreter; the times only show that each variant runs."]
    return out
