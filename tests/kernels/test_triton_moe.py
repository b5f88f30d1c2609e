"""Triton MoE: the router and the expert alignment (one launch each) and the sorted-token grouped GEMMs, each vs
its torch reference."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import moe
from service.engine.kernels.moe import align_by_expert_ref
from service.engine.kernels.tiles import ALIGN_TILE_VARIANTS, ROUTE_TILE_VARIANTS, AlignTiles, RouteTiles, default_tiles
from service.engine.kernels.triton_moe import moe_experts, moe_route
from service.engine.kernels.triton_moe_align import align_by_expert, align_into
from service.engine.kernels.triton_moe_route import moe_route_tiled
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, moe_inputs, needs_cuda

NANO = dict(d=2688, E=128, k=6)
SUPER = dict(d=4096, E=512, k=22)


def _inputs(T, E, k, d, inter, dtype, seed):
    return moe_inputs(T, E, k, d, inter, dtype, seed, with_bias=True)


def _router_inputs(T, E, d, dtype, seed):
    """h [T, d], gate [E, d] fp32 with logits ~ N(0, 1), bias [E] ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g).to(DEVICE, dtype)
    gate = (torch.randn(E, d, generator=g) * d**-0.5).to(DEVICE)
    return h, gate, (torch.randn(E, generator=g) * 0.1).to(DEVICE)


def _random_ids(T, E, k, seed):
    """[T, k] int64: k distinct experts per token, like a top-k."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous().to(DEVICE)


def _assert_alignment_equal(ids, E, block_m, kernel_ids=None, tiles=None):
    """Every tensor of the Triton alignment (of kernel_ids, default ids) equals the torch oracle's; the buffers are
    poisoned first, so a slot the kernel does not write fails too: a non-stable rank or a padding slot that is not
    the sentinel T*k fails here."""
    ref = align_by_expert_ref(ids, E, block_m)
    pairs = torch.full_like(ref.sorted_pairs, -7)
    blocks = torch.full_like(ref.block_expert, -7)
    out = align_into(ids if kernel_ids is None else kernel_ids, E, block_m, pairs, blocks, tiles)
    assert out.block_m == ref.block_m
    assert torch.equal(out.sorted_pairs, ref.sorted_pairs), (out.sorted_pairs, ref.sorted_pairs)
    assert torch.equal(out.block_expert, ref.block_expert), (out.block_expert, ref.block_expert)


def _assert_route_matches(h, gate, bias, k, n_group, topk_group, norm, tiles=None):
    """ids equal to moe_route_ref's, weights within 1e-5. In the interpreter both sum in fp32 on the CPU: every
    token must match. On a GPU (cuBLAS vs the kernel's summation order) tokens with a near tie are checked as
    equally good picks instead (`_check_near_ties`)."""
    w, ids = moe_route_tiled(h, gate, bias, k, n_group, topk_group, norm, 2.5, tiles)
    w_ref, ids_ref = moe.moe_route_ref(h, gate, bias, k, n_group, topk_group, norm, 2.5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == ids_ref.shape
    clear = torch.ones(h.shape[0], dtype=torch.bool, device=h.device)
    if DEVICE == "cuda":
        clear = ~_check_near_ties(h, gate, bias, k, n_group, topk_group, ids, ids_ref)
    assert torch.equal(ids[clear], ids_ref[clear]), f"{int((ids != ids_ref)[clear].any(-1).sum())} tokens differ"
    torch.testing.assert_close(w[clear], w_ref[clear], rtol=1e-5, atol=1e-5)
    return ids


# ---------------- moe_route ----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E,k,n_group,topk_group", [(8, 2, 1, 1), (8, 2, 4, 2), (64, 6, 1, 1), (64, 6, 4, 2)])
@pytest.mark.parametrize("T", [1, 7, 70])
def test_moe_route_matches_ref(T, E, k, n_group, topk_group, dtype):
    """T=1, 7: "fma" decode path, experts split over 8-wide slices (last-arriver select); T=70: 32-token
    blocks, "ieee" tl.dot (fp32/fp16 h) or "bf16x3" (bf16 h), E=64 in two slices, E=8 in one program."""
    h, gate, bias = _router_inputs(T, E, 48, dtype, seed=T + E + n_group)
    for norm in (True, False):
        _assert_route_matches(h, gate, bias, k, n_group, topk_group, norm)


def test_moe_route_super_experts():
    """E 512, top-22 (Super): 128 four-expert slices; the selection walks the 8-token block in 4-row steps."""
    _assert_route_matches(*_router_inputs(7, 512, 32, torch.float32, seed=11), 22, 1, 1, True)


def test_moe_route_super_experts_selected_apart():
    """E 512, top-22 with the selection in a second launch: the tile budgets cut its rows per program to 1."""
    tiles = RouteTiles("ieee", 16, 128, 16, 1, 4, select_rows=4)
    _assert_route_matches(*_router_inputs(3, 512, 32, torch.float32, seed=12), 22, 1, 1, True, tiles)


def test_moe_route_prefill_blocks():
    """T=1100: 64-token blocks, E=64 in 4 slices of 16, the selection in two 32-row steps; grouped."""
    _assert_route_matches(*_router_inputs(1100, 64, 32, torch.float32, seed=8), 6, 4, 2, True)


ROUTE_TILES_CPU = [  # (T, E, d, h dtype, tiles): K split in several slices, several token blocks
    (1, 64, 100, torch.float32, RouteTiles("fma", 1, 8, 16, 1, 4)),  # 8 x 7 arrivals, one step
    (7, 64, 100, torch.float16, RouteTiles("fma", 4, 16, 16, 2, 2)),  # 2 token blocks, 4 x 4 arrivals
    (40, 48, 100, torch.float32, RouteTiles("ieee", 16, 16, 16, 2, 4)),  # E not a power of 2, ragged K
    (40, 64, 160, torch.float32, RouteTiles("ieee", 16, 64, 16, 1, 4)),  # 10 K slices: two partial-sum loads
    (40, 64, 100, torch.bfloat16, RouteTiles("bf16x3", 16, 32, 16, 1, 4)),
    (33, 64, 100, torch.bfloat16, RouteTiles("bf16x3", 32, 16, 32, 2, 4)),
    (40, 64, 100, torch.bfloat16, RouteTiles("bf16x3", 16, 32, 16, 2, 4, select_rows=4)),  # two launches
    (37, 48, 100, torch.float32, RouteTiles("ieee", 16, 16, 16, 1, 4, select_rows=8)),  # ragged rows, 7 K slices
    (5, 64, 100, torch.float16, RouteTiles("fma", 4, 16, 16, 2, 2, select_rows=2)),
]


@pytest.mark.parametrize("T,E,d,dtype,tiles", ROUTE_TILES_CPU)
def test_moe_route_tiles_split_k(T, E, d, dtype, tiles):
    """Every mode with the hidden size split over programs (partial logits summed by the last program)."""
    h, gate, bias = _router_inputs(T, E, d, dtype, seed=T + d)
    _assert_route_matches(h, gate, bias, 6, 1, 1, True, tiles)
    _assert_route_matches(h, gate, bias, 6, 4, 2, False, tiles)


@pytest.mark.parametrize(
    "T,dtype,tiles",
    [
        (5, torch.float32, None),
        (40, torch.float32, None),
        (40, torch.bfloat16, None),
        (3, torch.float32, RouteTiles("fma", 4, 4, 8, 2, 1)),
    ],
)
def test_moe_route_exact_ties_pick_the_lowest_index(T, dtype, tiles):
    """Exact ties (integer h, gate rows repeated, multiples of 1/16: every summation order is exact): the picks
    are the stable descending order of the choices, i.e. ties go to the lowest expert index."""
    g = torch.Generator().manual_seed(T)
    h = torch.randint(-3, 4, (T, 32), generator=g).float()
    gate = (torch.randint(-2, 3, (8, 32), generator=g).float() / 16).repeat(8, 1)  # 64 experts, 8 distinct
    bias = torch.zeros(64)
    bias[40:] = 1 / 64
    w, ids = moe_route_tiled(h.to(DEVICE, dtype), gate.to(DEVICE), bias.to(DEVICE), 6, 1, 1, True, 1.0, tiles)
    s = torch.sigmoid(h @ gate.T)
    expect = torch.sort(s + bias, dim=1, descending=True, stable=True).indices[:, :6]
    assert torch.equal(ids.cpu(), expect), (ids, expect)
    w_ref = s.gather(1, expect)
    torch.testing.assert_close(w.cpu(), w_ref / w_ref.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)


def test_moe_route_rejects_bad_tiles():
    h, gate, bias = _router_inputs(3, 8, 16, torch.float32, seed=0)
    for tiles in (
        RouteTiles("bf16x3", 16, 16, 16, 1, 4),  # fp32 h: the bf16 split is not exact
        RouteTiles("ieee", 8, 16, 16, 1, 4),  # tl.dot needs 16-wide tiles
        RouteTiles("fma", 1, 8, 24, 1, 4),
        RouteTiles("tf32", 16, 16, 16, 1, 4),
        RouteTiles("ieee", 16, 16, 16, 1, 4, select_rows=3),  # rows per select program: a power of 2
    ):
        with pytest.raises(ValueError):
            moe_route_tiled(h, gate, bias, 2, 1, 1, True, 1.0, tiles)


def test_moe_route_group_limit_changes_the_choice():
    """The group limit is exercised: without it some token would pick other experts."""
    h, gate, bias = _router_inputs(70, 64, 48, torch.float32, seed=5)
    grouped = _assert_route_matches(h, gate, bias, 6, 4, 2, True)
    assert not torch.equal(grouped, moe_route(h, gate, bias, 6, 1, 1, True, 2.5)[1])


def test_moe_route_strided_h_and_empty():
    base, gate, bias = _router_inputs(9, 16, 40, torch.float32, seed=2)
    h = base[:, 4:36]  # unit stride in d, row stride 40
    gate = gate[:, :32].contiguous()
    _assert_route_matches(h, gate, bias, 3, 1, 1, True)
    w0, ids0 = moe_route(h[:0], gate, bias, 3, 1, 1, True, 1.0)
    assert w0.shape == (0, 3) and ids0.shape == (0, 3)


def test_moe_route_rejects_bad_arguments():
    h, gate, bias = _router_inputs(3, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError):
        moe_route(h, gate, bias, 9, 1, 1, True, 1.0)  # top_k > E
    with pytest.raises(ValueError):
        moe_route(h, gate, bias, 2, 3, 1, True, 1.0)  # n_group does not divide E
    with pytest.raises(ValueError):
        moe_route(h, gate, bias, 5, 4, 2, True, 1.0)  # top_k > experts in the kept groups
    with pytest.raises(ValueError):
        moe_route(h, gate[:, :8], bias, 2, 1, 1, True, 1.0)  # d mismatch


# ---------------- align_by_expert ----------------
@pytest.mark.parametrize("E", [8, 128])
@pytest.mark.parametrize("k", [1, 2, 6])
@pytest.mark.parametrize("T", [1, 3, 17, 70])
def test_align_by_expert_matches_ref(T, k, E):
    """T 70: several by-chunk programs with a partial last chunk for both E (k 6: 420 pairs; chunks of 128 pairs at
    E 8, of 16 at E 128); more pairs than one tile holds: test_align_by_expert_many_chunks_and_odd_sizes."""
    ids = _random_ids(T, E, k, seed=T * 10 + k)
    for block_m in (4, 16, 64):
        _assert_alignment_equal(ids, E, block_m)


@pytest.mark.parametrize("E,expert", [(8, 0), (8, 7), (128, 77)])
@pytest.mark.parametrize("block_m", [4, 16, 64])
def test_align_by_expert_skewed(E, expert, block_m):
    """Every pair on one expert (the others empty): one long run, then a long tail of unused blocks."""
    _assert_alignment_equal(torch.full((70, 6), expert, dtype=torch.int64, device=DEVICE), E, block_m)


def test_align_by_expert_many_chunks_and_odd_sizes():
    """5,000 pairs (several 1024-id chunks carry the stable rank across chunks), E not a power of two, block_m 24,
    int32 ids and a non-contiguous view; T = 0 gives only unused blocks."""
    ids = _random_ids(1000, 12, 5, seed=3)
    _assert_alignment_equal(ids, 12, 24)
    _assert_alignment_equal(ids, 12, 16, kernel_ids=ids.to(torch.int32))
    strided = _random_ids(40, 8, 4, seed=4)[:, ::2]
    fresh, ref = align_by_expert(strided, 8, 4), align_by_expert_ref(strided, 8, 4)
    assert torch.equal(fresh.sorted_pairs, ref.sorted_pairs) and torch.equal(fresh.block_expert, ref.block_expert)
    _assert_alignment_equal(torch.zeros(0, 6, dtype=torch.int64, device=DEVICE), 8, 16)


@pytest.mark.parametrize(
    "tiles",
    [
        AlignTiles(True, 4, 2, 4),
        AlignTiles(True, 8, 64, 2),
        AlignTiles(True, 32, 8, 4),
        AlignTiles(False, 128, 4, 4),
        AlignTiles(False, 256, 2, 8),
    ],
)
def test_align_by_expert_tiles(tiles):
    """Chunk owners (pairs before the chunk from a prefix histogram, ranks inside it from a [chunk, chunk] compare)
    and expert owners (several scan steps, the next one prefetched), uniform and skewed ids."""
    _assert_alignment_equal(_random_ids(17, 64, 6, seed=1), 64, 4, tiles=tiles)
    _assert_alignment_equal(torch.full((100, 3), 9, dtype=torch.int64, device=DEVICE), 64, 16, tiles=tiles)


def test_align_by_expert_rejects_bad_tiles():
    ids = _random_ids(700, 8, 3, seed=0)  # 2100 pairs: too many for one tile
    for tiles in (AlignTiles(True, 16, 1, 4), AlignTiles(False, 64, 1, 4), AlignTiles(False, 128, 3, 4)):
        with pytest.raises(ValueError):
            _assert_alignment_equal(ids, 8, 16, tiles=tiles)


def test_align_by_expert_super_experts():
    """E 512, top-22: 8 experts per program and a 1024-bin histogram."""
    _assert_alignment_equal(_random_ids(5, 512, 22, seed=6), 512, 16)


def test_align_by_expert_groups_every_pair_once():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [7, 3]], device=DEVICE)
    al = align_by_expert(ids, num_experts=8, block_m=4)
    pairs = al.sorted_pairs.view(-1, 4).cpu()
    experts = al.block_expert.cpu()
    seen = []
    for blk, e in zip(pairs.tolist(), experts.tolist()):
        real = [p for p in blk if p < ids.numel()]
        if e < 0:
            assert not real
            continue
        assert real and all(ids.flatten()[p].item() == e for p in real)
        seen += real
    assert sorted(seen) == list(range(ids.numel()))
    assert experts.tolist()[:4] == [0, 1, 3, 7]


# ---------------- moe_experts ----------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 40, 200])
def test_moe_experts_matches_ref(T, dtype):
    args = _inputs(T, E=8, k=2, d=32, inter=48, dtype=dtype, seed=T)
    out = moe_experts(*args)
    assert out.dtype == dtype
    assert_close(out, moe.moe_experts_ref(*args), dtype, "moe_experts")


def test_moe_experts_skewed_routing():
    """Every token on one expert (others empty), top_k = 1."""
    x, up, down, _, _ = _inputs(37, E=8, k=2, d=32, inter=48, dtype=torch.float32, seed=1)
    ids = torch.full((37, 1), 5, dtype=torch.int64, device=DEVICE)
    w = torch.rand(37, 1, device=DEVICE)
    assert_close(moe_experts(x, up, down, w, ids), moe.moe_experts_ref(x, up, down, w, ids), torch.float32, "moe")


# ---------------- GPU, real shapes ----------------
def _check_near_ties(h, gate, bias, k, n_group, topk_group, ids, ids_ref, margin=3e-6) -> torch.Tensor:
    """[T] bool: tokens whose fp64 choice has two of its top-(k+1) values (or two of its top-(topk_group+1) group
    scores) within `margin` (about 10x the fp32 error of s at d=4096): there fp32 summation order may legitimately
    pick or order differently. Asserts those are rare (<= 5 %, Super's top-22 of 512 has ~2 %: the exact check
    stays meaningful) and that both picks are equally good (their fp64 choices agree within margin)."""
    choice = torch.sigmoid(h.double() @ gate.double().T) + bias.double()
    T, E = choice.shape
    near = torch.zeros(T, dtype=torch.bool, device=choice.device)
    masked = choice
    if n_group > 1:
        gs = choice.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)
        top = gs.topk(min(topk_group + 1, n_group), dim=-1)
        near |= (top.values[:, :-1] - top.values[:, 1:]).min(-1).values < margin
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, top.indices[:, :topk_group], True)
        masked = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    vals = masked.topk(min(k + 1, E), dim=-1).values
    near |= (vals[:, :-1] - vals[:, 1:]).min(-1).values < margin
    assert near.float().mean().item() <= 0.05, f"{int(near.sum())} of {T} tokens are near ties"
    picked, picked_ref = choice.gather(1, ids)[near], choice.gather(1, ids_ref)[near]
    assert torch.allclose(picked.sort(-1).values, picked_ref.sort(-1).values, rtol=0, atol=margin)
    return near


@gpu
@needs_cuda
@pytest.mark.parametrize("shape,T", [(NANO, 1), (NANO, 64), (NANO, 256), (NANO, 8192), (SUPER, 1), (SUPER, 256)])
def test_moe_route_and_align_gpu_real_shapes(shape, T):
    """bf16 h; ids equal (near ties aside), weights within 1e-5; the alignment of those ids equal to the oracle's
    at every block_m moe_experts uses."""
    h, gate, bias = _router_inputs(T, shape["E"], shape["d"], torch.bfloat16, seed=T + shape["E"])
    ids = _assert_route_matches(h, gate, bias, shape["k"], 1, 1, True)
    for block_m in (16, 32, 64, 128):
        _assert_alignment_equal(ids, shape["E"], block_m)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_moe_route_gpu_grouped(T):
    _assert_route_matches(*_router_inputs(T, NANO["E"], NANO["d"], torch.bfloat16, seed=T), NANO["k"], 8, 4, False)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", sorted(ROUTE_TILE_VARIANTS))
def test_moe_route_tile_variants_gpu(T):
    """Every launch-shape variant the benchmark times (Nano, bf16 h): ids equal to the fp32 reference's (near ties
    aside), weights within 1e-5, grouped too; and deterministic (a second call is bitwise equal)."""
    h, gate, bias = _router_inputs(T, NANO["E"], NANO["d"], torch.bfloat16, seed=T + 1)
    for tiles in ROUTE_TILE_VARIANTS[T]:
        ids = _assert_route_matches(h, gate, bias, NANO["k"], 1, 1, True, tiles)
        _assert_route_matches(h, gate, bias, NANO["k"], 8, 4, False, tiles)
        w2, ids2 = moe_route_tiled(h, gate, bias, NANO["k"], 1, 1, True, 2.5, tiles)
        assert torch.equal(ids2, ids), tiles


@gpu
@needs_cuda
@pytest.mark.parametrize("T", sorted(ALIGN_TILE_VARIANTS))
def test_align_tile_variants_gpu(T):
    """Every alignment variant the benchmark times equals the oracle (uniform and skewed ids, Nano E=128, k=6)."""
    uniform = _random_ids(T, NANO["E"], NANO["k"], seed=T)
    skewed = torch.randint(0, 4, (T, NANO["k"]), device=DEVICE)
    for tiles in ALIGN_TILE_VARIANTS[T]:
        for block_m in sorted({16, default_tiles(T * NANO["k"] / NANO["E"], 2).block_m}):
            _assert_alignment_equal(uniform, NANO["E"], block_m, tiles=tiles)
            _assert_alignment_equal(skewed, NANO["E"], block_m, tiles=tiles)


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [4, 256])
def test_moe_route_and_align_in_cuda_graph_without_sync(T):
    """No host sync (torch's sync debug mode errors on one in an eager call; a sync inside the capture would fail
    it), and the captured ops replay right on new inputs (the arrival counters are re-zeroed inside the graph)."""
    h, gate, bias = _router_inputs(T, NANO["E"], NANO["d"], torch.bfloat16, seed=0)

    def step():
        w, ids = moe_route(h, gate, bias, NANO["k"], 1, 1, True, 2.5)
        return w, ids, align_by_expert(ids, NANO["E"], 16)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids, al = step()
    for seed in (1, 2, 3):
        h.copy_(_router_inputs(T, NANO["E"], NANO["d"], torch.bfloat16, seed=seed)[0])
        graph.replay()
        w_eager, ids_eager = moe_route(h, gate, bias, NANO["k"], 1, 1, True, 2.5)  # checked vs the ref above
        assert torch.equal(ids, ids_eager) and torch.equal(w, w_eager)
        ref = align_by_expert_ref(ids_eager, NANO["E"], 16)
        assert torch.equal(al.sorted_pairs, ref.sorted_pairs) and torch.equal(al.block_expert, ref.block_expert)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "T,dtype",
    [(1, torch.bfloat16), (128, torch.bfloat16), (2048, torch.bfloat16), (128, torch.float32), (2048, torch.float32)],
)
def test_moe_experts_gpu_nano_shapes(T, dtype):
    args = _inputs(T, E=128, k=6, d=2688, inter=1856, dtype=dtype, seed=T)
    assert_close(moe_experts(*args), moe.moe_experts_ref(*args), dtype, "moe_experts")


def test_max_expert_blocks_bounds_every_routing():
    """The static block count covers sum_e ceil(count_e / block_m) for any split of the pairs over the experts,
    including the worst case (every non-empty expert one pair past a block boundary)."""
    from service.engine.kernels.moe import max_expert_blocks

    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        E = int(torch.randint(1, 300, (1,), generator=g))
        bm = int(torch.randint(1, 130, (1,), generator=g))
        tk = int(torch.randint(0, 5000, (1,), generator=g))
        counts = torch.bincount(torch.randint(0, E, (tk,), generator=g), minlength=E) if tk else torch.zeros(E)
        assert int(((counts + bm - 1) // bm).sum()) <= max_expert_blocks(tk, E, bm)
        worst = min(E, tk)  # worst: `worst` experts with 1 + j * bm pairs
        if worst and tk >= worst:
            per = [1] * worst
            per[0] += tk - worst
            assert sum(-(-c // bm) for c in per) <= max_expert_blocks(tk, E, bm)
    assert max_expert_blocks(6, 128, 16) == 7  # Nano decode, batch 1: 7 blocks, not 129
