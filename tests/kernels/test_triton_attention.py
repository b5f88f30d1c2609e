"""Triton paged attention (decode split-KV and prefill with cached prefix) vs the torch reference."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import attention
from service.engine.kernels.tiles import DECODE_TILE_VARIANTS, DecodeTiles, PrefillTiles, decode_splits
from service.engine.kernels.triton_attention import paged_attention, paged_attention_tiled
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda


def _setup(qlens, plens, Hq, Hkv, Dh, page_size, dtype, seed):
    """Random caches whose pages are handed out in shuffled order; page_table padded with page 0."""
    g = torch.Generator().manual_seed(seed)
    ctx = [p + l for p, l in zip(plens, qlens)]
    pages_per_req = [-(-c // page_size) for c in ctx]
    num_pages = sum(pages_per_req) + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(qlens), max(pages_per_req), dtype=torch.int64)
    for i, n in enumerate(pages_per_req):
        table[i, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    k_cache = torch.randn(num_pages * page_size, Hkv, Dh, generator=g).to(DEVICE, dtype)
    v_cache = torch.randn(num_pages * page_size, Hkv, Dh, generator=g).to(DEVICE, dtype)
    q = torch.randn(sum(qlens), Hq, Dh, generator=g).to(DEVICE, dtype)
    qsl = [0]
    for l in qlens:
        qsl.append(qsl[-1] + l)
    return (
        q,
        k_cache,
        v_cache,
        table.to(DEVICE),
        torch.tensor(qsl, device=DEVICE),
        torch.tensor(plens, device=DEVICE),
        max(qlens),
        max(ctx),
        page_size,
        Dh**-0.5,
    )


CPU_CASES = [
    ([1, 1, 1], [0, 37, 300]),  # decode only, split-KV on the long request
    ([5, 17, 1], [6, 0, 9]),  # prefill with a cached prefix (p % page != 0), plus a decode row
    ([33, 2], [0, 3]),  # cold prefill over several key blocks
    ([20, 3], [130, 70]),  # long cached prefix: unmasked key blocks before the diagonal
    ([140, 2], [10, 0]),  # several query blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_paged_attention_matches_ref(case, dtype):
    qlens, plens = CPU_CASES[case]
    args = _setup(qlens, plens, Hq=4, Hkv=2, Dh=16, page_size=4, dtype=dtype, seed=case)
    out = paged_attention(*args)
    assert out.dtype == dtype
    assert_close(out, attention.paged_attention_ref(*args), dtype, "attention")


def test_paged_attention_rejects_bad_shapes():
    q, k, v, table, qsl, plens, mq, ms, ps, scale = _setup([2, 1], [0, 3], 4, 2, 16, 4, torch.float32, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention(q, k, v, table, qsl[:-1], plens, mq, ms, ps, scale)
    with pytest.raises(ValueError, match="head"):
        paged_attention(q[:, :3], k, v, table, qsl, plens, mq, ms, ps, scale)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(q, k, v, table, qsl, plens, 1, ms, ps, scale)
    with pytest.raises(ValueError, match="max_query_len"):  # the reference checks the bound against the data
        attention.paged_attention_ref(q, k, v, table, qsl, plens, 1, ms, ps, scale)


def test_paged_attention_decode_with_loose_seq_bound():
    """Decode launched from a bound far above every context (as a CUDA graph does) gives the same result."""
    qlens, plens = [1, 1, 1, 1], [0, 37, 300, 5]
    args = list(_setup(qlens, plens, Hq=4, Hkv=2, Dh=16, page_size=4, dtype=torch.float32, seed=7))
    ref = attention.paged_attention_ref(*args)
    args[7] = 4096
    assert_close(paged_attention(*args), ref, torch.float32, "attention")


# decode plans at CPU sizes: (plens, Hq, Hkv, page_size, tiles); every request decodes one token
DECODE_CASES = [
    ([0, 37, 300, 5], 4, 2, 4, DecodeTiles(16, 4, 2, programs=64, min_split=16)),  # many splits, short requests
    ([100, 2, 64], 8, 2, 16, DecodeTiles(32, 4, 2, programs=48, min_split=32)),  # GQA 4, ctx % page != 0
    ([63, 129, 1], 2, 2, 16, DecodeTiles(64, 4, 2, programs=24, min_split=64)),  # GQA 1, block spans pages
    ([250, 17], 8, 2, 4, DecodeTiles(16, 4, 2, programs=4, min_split=16)),  # one split: single pass
    ([200, 3, 90], 16, 1, 8, DecodeTiles(32, 4, 2, programs=64, min_split=96)),  # GQA 16, min_split > block
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_decode_split_plans_match_ref(case, dtype):
    plens, Hq, Hkv, page, tiles = DECODE_CASES[case]
    args = _setup([1] * len(plens), plens, Hq=Hq, Hkv=Hkv, Dh=16, page_size=page, dtype=dtype, seed=40 + case)
    out = paged_attention_tiled(*args, PrefillTiles(), tiles)
    assert out.dtype == dtype
    assert_close(out, attention.paged_attention_ref(*args), dtype, f"decode {tiles}")


def test_decode_split_plan_counts():
    """Splits come from host ints only: the program target (floor) capped by max_seq_len / min_split."""
    tiles = DecodeTiles(programs=264, min_split=256)
    assert decode_splits(1, 2, 8192, tiles) == 32  # 8192 / 256 keys per split
    assert decode_splits(32, 2, 1024, tiles) == 4  # 264 // 64
    assert decode_splits(128, 2, 1024, tiles) == 1  # 256 programs already: single pass
    assert decode_splits(1, 2, 100, tiles) == 1


@pytest.mark.parametrize("tiles", DECODE_TILE_VARIANTS, ids=str)
def test_decode_variants_match_ref_cpu(tiles):
    """Every tuned variant at small shapes, several splits and a loose sequence bound (as a CUDA graph passes)."""
    args = list(_setup([1] * 3, [700, 5, 1030], Hq=8, Hkv=2, Dh=16, page_size=64, dtype=torch.float16, seed=3))
    ref = attention.paged_attention_ref(*args)
    assert_close(paged_attention_tiled(*args, PrefillTiles(), tiles), ref, torch.float16, f"decode {tiles}")
    args[7] = 8192
    assert_close(paged_attention_tiled(*args, PrefillTiles(), tiles), ref, torch.float16, f"decode {tiles} loose")


GPU_CASES = [
    ([1] * 8, [0, 5, 63, 64, 1000, 3000, 17, 129], 16),
    ([1] * 128, [1024] * 128, 64),
    ([1000, 37, 1, 4096], [300, 0, 50, 0], 16),
    ([129, 64], [64 * 3 + 5, 1], 64),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_paged_attention_gpu_nano_shapes(case, dtype):
    qlens, plens, page = GPU_CASES[case]
    args = _setup(qlens, plens, Hq=32, Hkv=2, Dh=128, page_size=page, dtype=dtype, seed=20 + case)
    assert_close(paged_attention(*args), attention.paged_attention_ref(*args), dtype, "attention")


# the decode sizes of benchmarks/kernels.py's tune group (bf16), and two of them in fp32 (halved key steps)
GPU_DECODE_SIZES = [
    (1, 8192, torch.bfloat16),
    (32, 1024, torch.bfloat16),
    (128, 1024, torch.bfloat16),
    (256, 2048, torch.bfloat16),
    (1, 8192, torch.float32),
    (32, 1024, torch.float32),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", DECODE_TILE_VARIANTS, ids=str)
@pytest.mark.parametrize("size", GPU_DECODE_SIZES, ids=str)
def test_decode_variants_gpu_nano_shapes(size, tiles):
    """Every decode variant the tune benchmark may pick, at its Nano size (page 64), vs the reference."""
    B, ctx, dtype = size
    args = _setup([1] * B, [ctx - 1] * B, Hq=32, Hkv=2, Dh=128, page_size=64, dtype=dtype, seed=B)
    assert_close(
        paged_attention_tiled(*args, PrefillTiles(), tiles),
        attention.paged_attention_ref(*args),
        dtype,
        f"decode {tiles}",
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("tiles", DECODE_TILE_VARIANTS, ids=str)
def test_decode_variants_gpu_mixed_contexts_loose_bound(tiles):
    """Mixed contexts (1 .. 3000, not multiples of the page) under a CUDA-graph-like bound of 16384 keys."""
    plens = [(i * 389) % 3001 for i in range(48)]
    args = list(_setup([1] * 48, plens, Hq=32, Hkv=2, Dh=128, page_size=64, dtype=torch.bfloat16, seed=5))
    ref = attention.paged_attention_ref(*args)
    args[7] = 16384
    assert_close(paged_attention_tiled(*args, PrefillTiles(), tiles), ref, torch.bfloat16, f"decode {tiles}")
