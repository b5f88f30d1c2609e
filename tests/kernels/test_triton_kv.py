"""Triton write_kv (one launch for K and V) against `attention.write_kv_ref`."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import attention
from service.engine.kernels.triton_kv import write_kv
from tests.kernels.triton_test_util import DEVICE, gpu, needs_cuda


def _qkv_views(T: int, hq: int, hkv: int, dh: int, dtype: torch.dtype, seed: int):
    """k, v [T, hkv, dh] as strided column splits of one [T, (hq + 2 hkv) dh] tensor (the fused projection)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * dh, generator=g).to(DEVICE, dtype)
    q, kv = hq * dh, hkv * dh
    return qkv[:, q : q + kv].view(T, hkv, dh), qkv[:, q + kv :].view(T, hkv, dh)


def _check(T: int, S: int, hkv: int, dh: int, dtype: torch.dtype, cache_dtype: torch.dtype, seed: int) -> None:
    k, v = _qkv_views(T, 3, hkv, dh, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(S, generator=g)[:T].to(DEVICE)
    init = torch.randn(S, hkv, dh, generator=g).to(DEVICE, cache_dtype)
    ours = [init.clone(), init.clone()]
    ref = [init.clone(), init.clone()]
    write_kv(ours[0], ours[1], k, v, slots)
    attention.write_kv_ref(ref[0], ref[1], k, v, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])  # untouched rows kept, written rows exact


@pytest.mark.parametrize("T, S, hkv, dh", [(1, 8, 2, 16), (6, 40, 2, 16), (13, 64, 3, 24), (5, 9, 1, 8)])
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, torch.float16)],
)
def test_write_kv_matches_ref(T, S, hkv, dh, dtype, cache_dtype):
    _check(T, S, hkv, dh, dtype, cache_dtype, seed=T + S)


def test_write_kv_int32_slots_and_empty():
    k, v = _qkv_views(4, 2, 2, 16, torch.float32, 3)
    caches = [torch.zeros(10, 2, 16, device=DEVICE) for _ in range(2)]
    write_kv(caches[0], caches[1], k, v, torch.tensor([7, 1, 3, 9], dtype=torch.int32, device=DEVICE))
    assert torch.equal(caches[0][[7, 1, 3, 9]], k) and torch.equal(caches[1][[7, 1, 3, 9]], v)
    write_kv(caches[0], caches[1], k[:0], v[:0], torch.zeros(0, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(slots=torch.zeros(3, dtype=torch.int64)), "slot_mapping must have shape"),
        (dict(slots=torch.zeros(4)), "int32 or int64"),
        (dict(v_cache=torch.zeros(10, 2, 8)), "v_cache must have shape"),
        (dict(k=torch.zeros(4, 16, 2).transpose(1, 2)), "unit stride"),
    ],
)
def test_write_kv_bad_args(bad, words):
    args = dict(
        k_cache=torch.zeros(10, 2, 16),
        v_cache=torch.zeros(10, 2, 16),
        k=torch.zeros(4, 2, 16),
        v=torch.zeros(4, 2, 16),
        slots=torch.zeros(4, dtype=torch.int64),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=words):
        write_kv(args["k_cache"], args["v_cache"], args["k"], args["v"], args["slots"])


@gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 256, 8192])
def test_write_kv_gpu_nano(T):
    """Nano shapes (2 KV heads x 128), bf16, T decode rows to a whole 8K prefill."""
    _check(T, 16384, 2, 128, torch.bfloat16, torch.bfloat16, seed=T)
