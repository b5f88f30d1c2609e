"""The attention kernels on the strided views the fused qkv_proj hands them (q, k, v split from one output)."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import attention
from service.engine.kernels.triton_attention import paged_attention
from tests.kernels.triton_test_util import DEVICE

CASES = [([1, 1, 1], [0, 37, 300]), ([5, 17, 1], [6, 0, 9]), ([33, 2], [0, 3])]  # decode (split-KV); prefill


def _views(T: int, hq: int, hkv: int, dh: int, dtype: torch.dtype, seed: int):
    """q [T, hq, dh], k and v [T, hkv, dh] as views of one [T, (hq + 2 hkv) dh] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * dh, generator=g).to(DEVICE, dtype)
    q, kv = hq * dh, hkv * dh
    return (qkv[:, :q].view(T, hq, dh), qkv[:, q : q + kv].view(T, hkv, dh), qkv[:, q + kv :].view(T, hkv, dh))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_strided_q_equals_contiguous(case, dtype):
    """Same kernel, same values: a strided q gives bit-identical output to its contiguous copy."""
    qlens, plens = CASES[case]
    hq, hkv, dh, page_size = 4, 2, 16, 4
    ctx = [p + l for p, l in zip(plens, qlens)]
    pages = [-(-c // page_size) for c in ctx]
    table = torch.zeros(len(qlens), max(pages), dtype=torch.int64)
    start = 1
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(start, start + n)
        start += n
    g = torch.Generator().manual_seed(case)
    k_cache, v_cache = (torch.randn(start * page_size, hkv, dh, generator=g).to(DEVICE, dtype) for _ in range(2))
    q = _views(sum(qlens), hq, hkv, dh, dtype, case)[0]
    assert not q.is_contiguous() or q.shape[0] == 1
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), device=DEVICE)
    rest = (
        k_cache,
        v_cache,
        table.to(DEVICE),
        qsl,
        torch.tensor(plens, device=DEVICE),
        max(qlens),
        max(ctx),
        page_size,
        dh**-0.5,
    )
    out = paged_attention(q, *rest)
    assert out.is_contiguous()
    assert torch.equal(out, paged_attention(q.contiguous(), *rest))


def test_write_kv_from_strided_views():
    _, k, v = _views(6, 4, 2, 16, torch.float32, 0)
    assert not k.is_contiguous() and not v.is_contiguous()
    slots = torch.tensor([9, 2, 7, 0, 11, 5], device=DEVICE)
    caches = [torch.zeros(12, 2, 16, device=DEVICE) for _ in range(4)]
    attention.write_kv_ref(caches[0], caches[1], k, v, slots)
    attention.write_kv_ref(caches[2], caches[3], k.contiguous(), v.contiguous(), slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[0][slots], k) and torch.equal(caches[1][slots], v)
