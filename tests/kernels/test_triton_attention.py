"""Triton paged attention (decode split-KV and prefill with cached prefix) vs the torch reference."""
from __future__ import annotations

import pytest
import torch

from triton_test_util import DEVICE, assert_close, gpu, needs_cuda
from service.engine.kernels import attention
from service.engine.kernels.triton_attention import paged_attention


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
    return (q, k_cache, v_cache, table.to(DEVICE), torch.tensor(qsl, device=DEVICE), torch.tensor(plens, device=DEVICE),
            max(qlens), max(ctx), page_size, Dh ** -0.5)


CPU_CASES = [
    ([1, 1, 1], [0, 37, 300]),            # decode only, split-KV on the long request
    ([5, 17, 1], [6, 0, 9]),               # prefill with a cached prefix (p % page != 0), plus a decode row
    ([33, 2], [0, 3]),                     # cold prefill over several key blocks
    ([20, 3], [130, 70]),                  # long cached prefix: unmasked key blocks before the diagonal
    ([140, 2], [10, 0]),                   # several query blocks
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
    with pytest.raises(ValueError, match="max_query_len"):       # the reference checks the bound against the data
        attention.paged_attention_ref(q, k, v, table, qsl, plens, 1, ms, ps, scale)


def test_paged_attention_decode_with_loose_seq_bound():
    """Decode launched from a bound far above every context (as a CUDA graph does) gives the same result."""
    qlens, plens = [1, 1, 1, 1], [0, 37, 300, 5]
    args = list(_setup(qlens, plens, Hq=4, Hkv=2, Dh=16, page_size=4, dtype=torch.float32, seed=7))
    ref = attention.paged_attention_ref(*args)
    args[7] = 4096
    assert_close(paged_attention(*args), ref, torch.float32, "attention")


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
