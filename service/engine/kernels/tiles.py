"""Launch shapes of the Triton kernels and the tuning tables: for each kernel its tile dataclass, the variants the
benchmarks time and the GPU tests check (the first of each table is the default, measured on H200, see
benchmarks/RESULTS.md), and the functions that pick a launch shape from the problem size. The kernels and their
launchers are in the `triton_*` modules; the pure-torch references in the others."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType

import torch
import triton

from service.engine.kernels.triton_common import TARGET_PROGRAMS

# ---- attention (triton_attention) ----


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape of `_prefill_kernel`."""

    block_m: int = 128  # queries per program (16 when every request has <= 16 new tokens)
    block_n: int = 128  # keys per inner step
    warps: int = 8  # warps per program
    stages: int = 2  # software-pipelining depth


@dataclass(frozen=True)
class DecodeTiles:
    """Launch shape and split plan of `_decode_kernel`. Splits per (request, KV head): about `programs` programs in
    all (floor, at least 1 split), at most max_seq_len / min_split; a request's keys are spread evenly over them in
    multiples of block_n, at least min_split keys each (splits past its context stay empty). fp32 operands take
    half the keys per step (twice the bytes per key)."""

    block_n: int = 128  # keys per inner step (may span pages)
    warps: int = 4  # warps per program
    stages: int = 3  # software pipelining (triton 3.x: 5 double-buffers the K/V tiles, 2-4 one buffer)
    programs: int = TARGET_PROGRAMS  # programs the split plan aims for
    min_split: int = 128  # fewest keys per split (rounded up to a multiple of block_n)


# Launch shapes the `tune` benchmark compares at decode sizes (the GPU tests check each); the first is the default,
# the fastest measured on H200 (see benchmarks/RESULTS.md).
DECODE_TILE_VARIANTS = (
    DecodeTiles(),
    DecodeTiles(64, 4, 5),
    DecodeTiles(128, 8, 5, min_split=256),
    DecodeTiles(64, 4, 5, programs=132, min_split=512),
    DecodeTiles(64, 4, 5, programs=2 * TARGET_PROGRAMS, min_split=64),
)


def decode_splits(batch: int, kv_heads: int, max_seq_len: int, tiles: DecodeTiles) -> int:
    """KV splits per (request, KV head) from host ints only (a captured decode graph replays it for any lengths)."""
    return max(1, min(tiles.programs // (batch * kv_heads), triton.cdiv(max_seq_len, tiles.min_split)))


# ---- causal conv1d (triton_conv1d) ----


@dataclass(frozen=True)
class ConvTiles:
    """Launch shape of `_conv_varlen_kernel`: a program slides over `block_t` tokens of `block_d` channels, `rows`
    tokens per step (the next step's rows load while a step computes); each thread holds block_d / (32 * warps)
    channels of every row of a step."""

    block_t: int = 64  # tokens per program (a multiple of rows)
    block_d: int = 512  # channels per program
    warps: int = 4  # warps per program
    rows: int = 8  # tokens per step


# Launch shapes the `tune` benchmark compares at Nano shapes (the GPU tests check each); the first is the default.
CONV_TILE_VARIANTS = (
    ConvTiles(64, 512, 4, 8),
    ConvTiles(64, 512, 4, 4),
    ConvTiles(32, 512, 4, 8),
    ConvTiles(64, 256, 2, 8),
    ConvTiles(128, 512, 4, 16),
)


# ---- single-row GEMV (triton_gemv) ----


@dataclass(frozen=True)
class GemvTiles:
    """Launch shape of `gemv` (for one row of x; more rows may halve block_k, see `_rows_block_k`)."""

    block_n: int = 8  # weight rows (output columns) per program
    block_k: int = 256  # K elements per step and row (>= 8 bf16 per thread: 16-byte loads)
    warps: int = 4  # warps per program
    prefetch: bool = True  # load step k+1 before step k's FMAs (registers; tl's num_stages does not
    # pipeline loads that feed no tl.dot: it is 1 here)
    split_k: int = 1  # programs per column block, each over a slice of K (> 1: last arriver adds)
    mma: int = 0  # > 0: tensor-core tiles (`triton_gemv.mma_tiles`, block_n >= 16), the K loop pipelined this many
    # stages deep; 0: fp32 FMA register tiles

    def __post_init__(self):
        if self.mma and self.block_n < 16:
            raise ValueError(f"tensor-core tiles (mma > 0) need block_n >= 16, got {self}")


# Launch shapes the `gemv` benchmark compares per Nano-30B-A3B shape (N, K); the GPU tests check every one.
_WIDE = (
    GemvTiles(8, 256, 4),
    GemvTiles(8, 256, 4, False),
    GemvTiles(16, 128, 4),
    GemvTiles(8, 512, 4),
    GemvTiles(32, 128, 8),
    GemvTiles(16, 256, 8),
    GemvTiles(4, 1024, 4, False),
)
# The first of each is the default (measured on H200, see benchmarks/RESULTS.md); on the wide shapes cuBLAS ties.
_SHORT_K = (
    GemvTiles(4, 512, 4),
    GemvTiles(8, 256, 4, False),
    GemvTiles(8, 256, 4),
    GemvTiles(8, 128, 4, True, 3),
    GemvTiles(16, 128, 4, True, 3),
    GemvTiles(8, 256, 4, True, 2),
    GemvTiles(4, 1024, 4, False),
)
_LONG_K = (
    GemvTiles(4, 512, 4),
    GemvTiles(8, 512, 4, False),
    GemvTiles(8, 512, 4),
    GemvTiles(8, 512, 4, True, 2),
    GemvTiles(16, 256, 4, True, 4),
    GemvTiles(8, 256, 4, True, 4),
    GemvTiles(4, 1024, 4, False, 2),
)
GEMV_SHAPES = (
    ("in_proj", 10304, 2688),
    ("out_proj", 2688, 4096),
    ("qkv_proj", 4608, 2688),
    ("shared_up", 3712, 2688),
    ("shared_down", 2688, 3712),
    ("lm_head", 131072, 2688),
)
GEMV_TILE_VARIANTS = MappingProxyType(
    {
        (10304, 2688): _WIDE,
        (131072, 2688): _WIDE,  # mamba in_proj, lm_head: enough programs without split
        (4608, 2688): _SHORT_K,
        (3712, 2688): _SHORT_K,  # attention q/k/v (one GEMV), shared-expert up
        (2688, 4096): _LONG_K,
        (2688, 3712): _LONG_K,  # mamba out_proj / attention o_proj, shared-expert down
    }
)


def _fp8_gemv_variants(variants: tuple[GemvTiles, ...]) -> tuple[GemvTiles, ...]:
    """FP8 weights (1 byte): each bf16 variant with twice the K elements per step (the same bytes per load), then
    the first three bf16 variants as they are, then a tensor-core variant."""
    doubled = [dataclasses.replace(v, block_k=2 * v.block_k) for v in variants]
    mma = GemvTiles(64, 128, 4, split_k=4, mma=4)  # tensor cores: 64-row tiles, 4 K slices, 4 pipeline stages
    return tuple(dict.fromkeys(doubled + list(variants[:3]) + [mma]))


# The FP8 defaults of Nano's FP8 linears (mamba in_proj, out_proj), in CUDA-graph chains on H200
# (benchmarks/fp8_decode_sweep.py): in_proj 10.5 us (2.6 TB/s) against 15.0 us for (8, 512, 4), out_proj 5.3 us
# against 7.3 us for (4, 1024, 4); FMA tiles without the register prefetch (tensor-core and split-K tiles: slower).
_FP8_GEMV_DEFAULTS = {(10304, 2688): GemvTiles(4, 256, 2, False), (2688, 4096): GemvTiles(4, 1024, 2, False)}
_FP8_GEMV_NEXT = {(10304, 2688): GemvTiles(8, 256, 4, False), (2688, 4096): GemvTiles(8, 1024, 4, False)}
# Launch shapes the `gemv` benchmark compares for FP8 weights (the GPU tests check every one); first = default.
GEMV_FP8_TILE_VARIANTS = MappingProxyType(
    {
        shape: tuple(
            dict.fromkeys(
                tuple(v for v in (_FP8_GEMV_DEFAULTS.get(shape), _FP8_GEMV_NEXT.get(shape)) if v)
                + _fp8_gemv_variants(vs)
            )
        )
        for shape, vs in GEMV_TILE_VARIANTS.items()
    }
)


def default_gemv_tiles(n: int, k: int, fp8: bool = False) -> GemvTiles:
    """The first variant of a tuned shape (of the FP8 table for FP8 weights); otherwise 8-row blocks of 256 (FP8:
    512) K elements per step, split over K up to 4 ways until there are about TARGET_PROGRAMS programs."""
    table = GEMV_FP8_TILE_VARIANTS if fp8 else GEMV_TILE_VARIANTS
    if (n, k) in table:
        return table[(n, k)][0]
    blocks = triton.cdiv(max(n, 1), 8)
    return GemvTiles(8, 512 if fp8 else 256, 4, True, max(1, min(4, TARGET_PROGRAMS // blocks)))


# ---- expert alignment and grouped GEMMs (triton_moe) ----


@dataclass(frozen=True)
class AlignTiles:
    """Launch shape of `align_into`: grid max(cdiv(T*k, chunk) if by_chunk, cdiv(E, epp))."""

    by_chunk: bool  # program p places the pairs of chunk p (T*k <= BY_CHUNK_MAX), else of its experts
    chunk: int  # by_chunk: pairs per program; else ids per scan step
    epp: int  # experts per program (their sentinels and blocks; else also their pairs)
    warps: int


BY_CHUNK_MAX = 2048  # pairs held in one tile by every program of the by-chunk kernel


def align_tiles(tk: int, num_experts: int) -> AlignTiles:
    """tk <= BY_CHUNK_MAX: chunks of 4096 / HIST pairs ([chunk, HIST] one-hot picks; Nano: 16, T=256 -> 96
    programs) and >= 8 programs for the sentinels. Larger: about 128 programs of experts (each reads every id twice,
    4096 per step, the next step's ids loading meanwhile)."""
    hist = hist_bins(num_experts)
    if tk <= BY_CHUNK_MAX:
        chunk = max(1, 4096 // hist)
        progs = max(8, triton.cdiv(tk, chunk))
        return AlignTiles(True, chunk, min(triton.next_power_of_2(triton.cdiv(num_experts, progs)), 8192 // hist), 4)
    epp = min(triton.next_power_of_2(triton.cdiv(num_experts, 128)), max(1, 8192 // hist))
    return AlignTiles(False, max(128, 4096 // epp), epp, 8)


# Launch-shape variants timed by benchmarks/kernels.py (group "route") and checked by the GPU tests; keys: T at
# Nano shapes (k=6, E=128), the first of each list = `align_tiles`' pick.
ALIGN_TILE_VARIANTS = {
    1: [
        AlignTiles(True, 16, 16, 4),
        AlignTiles(True, 16, 32, 4),
        AlignTiles(True, 16, 8, 4),
        AlignTiles(True, 8, 16, 2),
        AlignTiles(True, 16, 4, 4),
    ],
    256: [
        AlignTiles(True, 16, 2, 4),
        AlignTiles(True, 8, 1, 4),
        AlignTiles(True, 32, 4, 8),
        AlignTiles(True, 16, 2, 8),
        AlignTiles(False, 1024, 8, 4),
    ],
    8192: [
        AlignTiles(False, 4096, 1, 8),
        AlignTiles(False, 2048, 1, 8),
        AlignTiles(False, 2048, 1, 4),
        AlignTiles(False, 4096, 2, 8),
        AlignTiles(False, 1024, 1, 4),
        AlignTiles(False, 2048, 2, 8),
    ],
}


def hist_bins(num_experts: int) -> int:
    return max(32, triton.next_power_of_2(num_experts + 1))  # bins: the experts + a spare one (>= 32)


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape of both grouped GEMMs."""

    block_m: int  # sorted (token, slot) rows per program; each expert's run is padded to it
    block_n: int  # output columns per program
    block_k: int  # reduction step
    warps: int  # warps per program
    stages: int  # software-pipelining depth


# Decode launch shapes (<= 16 pairs per expert) the `moe_tune` benchmark compares at T = 1, 8, 64 (the GPU tests
# check each); the first is the default.
MOE_DECODE_TILE_VARIANTS = (
    MoeTiles(16, 64, 128, 4, 4),
    MoeTiles(16, 32, 128, 4, 4),
    MoeTiles(16, 32, 256, 4, 3),
    MoeTiles(16, 64, 256, 4, 3),
    MoeTiles(16, 64, 128, 8, 5),
    MoeTiles(16, 128, 128, 8, 4),
)


def default_tiles(pairs_per_expert: float, element_size: int) -> MoeTiles:
    """Tiles for the average rows per expert: weight streaming (decode) vs matrix-bound (prefill);
    4-byte operands get a smaller prefill tile so the pipeline fits in shared memory, 1-byte (e4m3) a longer K."""
    if element_size == 1:  # e4m3 operands (W8A8): twice the K per step of the bf16 tiles, the same bytes
        if pairs_per_expert <= 16:
            return MoeTiles(16, 64, 256, 4, 4)
        if pairs_per_expert <= 32:
            return MoeTiles(32, 64, 256, 4, 4)
        # large decode batches (Nano at T=1024: 62 % of copy bandwidth, against 42 % with the 32-row tile); prefill
        # (Nano at T=8192, 384 pairs per expert: 2.08 ms per layer against 2.22 ms for (128, 256, 128, 8, 3))
        return MoeTiles(64, 128, 128, 4, 4) if pairs_per_expert <= 48 else MoeTiles(128, 128, 128, 4, 3)
    if pairs_per_expert <= 16:
        return MOE_DECODE_TILE_VARIANTS[0]
    if pairs_per_expert <= 48:  # large decode batches: bf16 streams the weights best through 64x128 tiles
        return MoeTiles(64, 128, 64, 4, 3) if element_size == 2 else MoeTiles(32, 64, 128, 4, 4)
    return MoeTiles(128, 256, 64, 8, 4) if element_size == 2 else MoeTiles(64, 128, 64, 4, 3)


# ---- grouped expert GEMVs (triton_moe_gemv) ----


@dataclass(frozen=True)
class ExpertGemvTiles:
    """Launch shape of a grouped-GEMV pass (`moe_experts_gemv` takes one for both passes, or one each)."""

    block_n: int = 4  # weight rows (outputs) per program
    block_k: int = 512  # reduction elements per step (16-byte loads of bf16)
    warps: int = 4  # warps per program
    depth: int = 2  # weight tiles in flight per program, in registers: 1 = load, then FMA; 2 = the next
    # step's tile loaded before this step's FMAs (`dot_tiles`' prefetch); 3-4 = 2-3 ahead
    stages: int = 1  # > 1 (with depth 1): the K loop is `tl.range(num_stages=stages)`, Triton's pipeliner
    # keeps stages - 1 steps of loads in flight through shared memory (the launch's
    # num_stages would pipeline only loads feeding tl.dot: none here)
    mma: int = 0  # > 0: tensor-core tiles (`triton_gemv.mma_tiles`, block_n >= 16; depth and stages unused), the K
    # loop pipelined this many stages deep; 0: fp32 FMA register tiles
    shared_chunks: int = 1  # down pass: the shared expert's K (S) in this many chunks, each a unit of its own, so
    # that a shared expert of S ~ n * I gives n programs as long as a routed slot's (not one n times longer)

    def __post_init__(self):
        if self.shared_chunks < 1:
            raise ValueError(f"shared_chunks must be >= 1, got {self.shared_chunks}")
        if not 1 <= self.depth <= 4:
            raise ValueError(f"depth must be 1..4, got {self.depth}")
        if self.stages < 1 or (self.stages > 1 and self.depth != 1):
            raise ValueError(f"stages > 1 pipelines the plain loop: needs depth 1, got {self}")
        if self.mma and self.block_n < 16:
            raise ValueError(f"tensor-core tiles (mma > 0) need block_n >= 16, got {self}")


# FP8 expert weights, (up pass, down pass), the first the default: tensor-core tiles of 64 rows; the down pass with
# the shared expert's K in two chunks. Nano at batch 1 in CUDA-graph chains on H200 (benchmarks/fp8_decode_sweep.py,
# two rounds): up 15.5 us (2.6 TB/s), down 15.6 us incl. the slot sum, the layer 32.0 us against 40.2 us for the
# second pair (the shared expert as one unit: its programs twice as long, the down pass 24.7 us); 128-row up tiles
# tie (15.5-17.1 us); FMA tiles 16-25 us per pass. The GPU tests check every pair.
EXPERT_GEMV_FP8_TILE_VARIANTS = (
    (ExpertGemvTiles(64, 128, 4, mma=4), ExpertGemvTiles(64, 128, 4, mma=3, shared_chunks=2)),
    (ExpertGemvTiles(64, 128, 4, mma=4), ExpertGemvTiles(64, 128, 4, mma=4)),
    (ExpertGemvTiles(128, 128, 8, mma=4), ExpertGemvTiles(64, 128, 4, mma=3, shared_chunks=2)),
    (ExpertGemvTiles(32, 256, 4, mma=4), ExpertGemvTiles(32, 256, 4, mma=4, shared_chunks=2)),
)
EXPERT_GEMV_FP8_TILES, EXPERT_GEMV_FP8_DOWN_TILES = EXPERT_GEMV_FP8_TILE_VARIANTS[0]
EXPERT_GEMV_TILE_VARIANTS = (
    ExpertGemvTiles(),
    ExpertGemvTiles(8, 256, 4),
    ExpertGemvTiles(8, 512, 4),
    ExpertGemvTiles(4, 1024, 4),
    ExpertGemvTiles(16, 256, 8),
)


# ---- activation quantization (triton_fp8) ----


@dataclass(frozen=True)
class QuantizeTiles:
    """Launch shape of `quantize_fp8`: programs of rows x block elements (block capped at K's next power of 2)."""

    block: int  # columns per program (a power of 2)
    rows: int  # rows per program (a power of 2)
    warps: int


# Launch shapes the `fp8` benchmark group times (the tests check each); the first is the default: one row per
# program (Nano on H200: 5.7 us at T=256 against 6.6 us for 4 rows; at T=8192 4 rows take 97.7 us against 102.0 us,
# too little to change the default for).
QUANTIZE_TILE_VARIANTS = (
    QuantizeTiles(1024, 1, 4),
    QuantizeTiles(1024, 4, 4),
    QuantizeTiles(1024, 8, 8),
    QuantizeTiles(512, 8, 4),
    QuantizeTiles(2048, 4, 8),
)


# ---- router (triton_moe_route) ----


@dataclass(frozen=True)
class RouteTiles:
    """Launch shape of the router: grid (cdiv(T, block_t), cdiv(E, block_e), cdiv(d, block_k * k_steps))."""

    mode: str  # "fma", "ieee" or "bf16x3" (bf16 h only), see the module docstring
    block_t: int  # tokens per program (>= 16 for the dot modes)
    block_e: int  # experts per program (>= 16 for the dot modes)
    block_k: int  # reduction step over the hidden size (>= 16 for the dot modes)
    k_steps: int  # steps per program: its K slice is block_k * k_steps ("fma": unrolled, <= 16)
    warps: int
    stages: int = 3
    select_rows: int = 0  # 0: one launch, the last program of a token block selects its rows; > 0 (a power of 2):
    # a second launch selects, this many rows per program (the logits programs carry no selection code)


def route_tiles(T: int, e_pad: int, d: int, dtype: torch.dtype) -> RouteTiles:
    """T <= 8 (decode): "fma", 256-wide K slices and e_pad / 16 experts per program (Nano: 16 x 11 = 176 programs,
    8 KB of W each, every load in flight at once), one launch. Larger T: "bf16x3" for bf16 h ("ieee" otherwise) on
    16/32/64-token blocks; K split so that there are about TARGET_PROGRAMS programs while the last program of a token
    block sums at most 64K partial logits. bf16 h above 64 tokens takes the tiles measured fastest, with the
    selection in a second launch (one program per 2-4 rows instead of one per token block): up to 512 tokens 16 x 64
    tiles, 3 K steps per slice, 2 rows per select program (Nano T=256: 16 x 2 x 14 programs, 12.6 us against 43.4 us
    for one launch); up to 2048 tokens 32 x 64 tiles over 6 K steps (T=1024: 32 x 2 x 7, 23.1 us against 104.6 us
    for 128 x 64 tiles over the whole K in one launch); above, 128 x 64 tiles over the whole K (T=8192: 64 x 2 x 1,
    71.5 us against 102.9 us in one launch); measured on H200, see benchmarks/RESULTS.md."""
    if T <= 8:
        bt = triton.next_power_of_2(T)
        bk = max(32, 256 // bt)
        return RouteTiles("fma", bt, max(8, e_pad // 16), bk, 256 // bk, 4)
    mode = "bf16x3" if dtype == torch.bfloat16 else "ieee"
    steps = triton.cdiv(d, 64)
    if mode == "bf16x3" and T > 64:
        if T <= 512:
            n_ks = max(1, min(triton.cdiv(steps, 3), 65536 // (16 * e_pad)))
            return RouteTiles(mode, 16, min(64, e_pad), 64, triton.cdiv(steps, n_ks), 4, select_rows=2)
        if T <= 2048:
            return RouteTiles(mode, 32, min(64, e_pad), 64, 6, 4, select_rows=4)
        return RouteTiles(mode, 128, min(64, e_pad), 64, steps, 8, select_rows=4)
    bt, be = (16, 32) if T <= 64 else (32, 64) if T <= 512 else (64, 128)
    be = min(be, e_pad)
    blocks = triton.cdiv(T, bt) * triton.cdiv(e_pad, be)
    n_ks = max(1, min(TARGET_PROGRAMS // blocks, 65536 // (bt * e_pad)))
    return RouteTiles(mode, bt, be, 64, triton.cdiv(triton.cdiv(d, 64), n_ks), 4 if bt * be <= 2048 else 8)


# Launch-shape variants timed by benchmarks/kernels.py (group "route") and checked by the GPU tests; the first of
# each list is `route_tiles`' pick at Nano shapes (E=128, d=2688, bf16 h). The two-launch variants (select_rows > 0)
# spread the selection over T / select_rows programs.
ROUTE_TILE_VARIANTS = {
    1: [
        RouteTiles("fma", 1, 8, 256, 1, 4),
        RouteTiles("fma", 1, 16, 128, 1, 4),
        RouteTiles("fma", 1, 16, 256, 1, 4),
        RouteTiles("fma", 1, 8, 128, 1, 4),
        RouteTiles("fma", 1, 4, 512, 1, 4),
        RouteTiles("fma", 1, 8, 256, 1, 2),
        RouteTiles("fma", 1, 8, 512, 1, 8),
        RouteTiles("fma", 1, 32, 128, 1, 4),
    ],
    256: [
        RouteTiles("bf16x3", 16, 64, 64, 3, 4, select_rows=2),
        RouteTiles("bf16x3", 16, 64, 64, 3, 4),
        RouteTiles("bf16x3", 16, 64, 64, 3, 4, select_rows=4),
        RouteTiles("bf16x3", 32, 64, 64, 3, 4, select_rows=4),
        RouteTiles("bf16x3", 32, 64, 64, 3, 4, select_rows=2),
        RouteTiles("bf16x3", 16, 64, 64, 6, 4, select_rows=4),
        RouteTiles("bf16x3", 16, 64, 64, 3, 4, select_rows=8),
    ],
    1024: [
        RouteTiles("bf16x3", 32, 64, 64, 6, 4, select_rows=4),
        RouteTiles("bf16x3", 128, 64, 64, 42, 8),
        RouteTiles("bf16x3", 32, 64, 64, 6, 4, select_rows=2),
        RouteTiles("bf16x3", 32, 128, 64, 6, 4, select_rows=4),
        RouteTiles("bf16x3", 16, 64, 64, 6, 4, select_rows=4),
        RouteTiles("bf16x3", 64, 64, 64, 6, 8, select_rows=4),
    ],
    8192: [
        RouteTiles("bf16x3", 128, 64, 64, 42, 8, select_rows=4),
        RouteTiles("bf16x3", 128, 64, 64, 42, 8),
        RouteTiles("bf16x3", 128, 64, 64, 21, 8, select_rows=4),
        RouteTiles("bf16x3", 128, 64, 64, 42, 8, select_rows=2),
        RouteTiles("bf16x3", 128, 128, 64, 21, 8, select_rows=8),
        RouteTiles("bf16x3", 64, 64, 32, 84, 4),
        RouteTiles("bf16x3", 32, 64, 64, 6, 4, select_rows=4),
    ],
}


# ---- SSD (triton_ssd) ----


@dataclass(frozen=True)
class SsdTiles:
    """Launch shapes of `ssd_varlen` (block sizes are capped by the problem's own padded sizes)."""

    scan_block_m: int = 64  # chunk rows per `_chunk_scan_kernel` program
    scan_block_k: int = 64  # source rows per inner step of the intra-chunk product
    scan_warps: int = 4  # warps of `_chunk_scan_kernel`
    pass_block: int = 256  # state elements (of P*N) per `_state_passing_kernel` program
    state_block_k: int = 64  # tokens per inner step of `_chunk_state_kernel`
