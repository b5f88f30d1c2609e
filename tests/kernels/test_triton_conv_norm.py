"""Triton conv1d (varlen + decode update) and RMSNorm / gated group RMSNorm vs the torch references."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import conv1d, norm
from service.engine.kernels.triton_conv1d import causal_conv1d_update, causal_conv1d_update_slots, causal_conv1d_varlen
from service.engine.kernels.triton_norm import gated_group_rms_norm, rms_norm
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda


def _conv_inputs(qlens, Dm, K, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    T = sum(qlens)
    packed = torch.randn(T, Dm + 7, generator=g).to(DEVICE, dtype)
    x = packed[:, 3 : 3 + Dm]  # strided rows, like in_proj's split
    weight = (torch.randn(Dm, K, generator=g) * 0.5).to(DEVICE, dtype)
    bias = torch.randn(Dm, generator=g).to(DEVICE, dtype) if with_bias else None
    init = torch.randn(len(qlens), Dm, K - 1, generator=g).to(DEVICE, dtype)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), device=DEVICE)
    token_req = torch.repeat_interleave(torch.arange(len(qlens)), torch.tensor(qlens)).to(DEVICE)
    return x, weight, bias, init, qsl, token_req


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qlens,K,with_bias", [([1, 2, 5, 9], 4, True), ([3, 1, 17], 4, False), ([4, 2], 2, True)])
def test_conv_varlen_matches_ref(qlens, K, with_bias, dtype):
    args = _conv_inputs(qlens, 40, K, dtype, seed=len(qlens) + K, with_bias=with_bias)
    out = causal_conv1d_varlen(*args)
    ref = conv1d.causal_conv1d_varlen_ref(*args)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "conv varlen")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K,with_bias", [(4, True), (4, False), (2, True)])
def test_conv_update_matches_ref(K, with_bias, dtype):
    x, weight, bias, _, _, _ = _conv_inputs([1, 1, 1], 40, K, dtype, seed=K, with_bias=with_bias)
    state = torch.randn(3, 40, K - 1).to(DEVICE, torch.float32)  # state kept in another dtype than x
    out, new = causal_conv1d_update(x, weight, bias, state)
    ref, new_ref = conv1d.causal_conv1d_update_ref(x, weight, bias, state)
    assert new.dtype == state.dtype
    assert_close(out, ref, dtype, "conv update")
    assert torch.equal(new, new_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("K,with_bias", [(4, True), (2, False)])
def test_conv_update_slots_matches_ref(K, with_bias, dtype):
    """In place on the pool by slot id; other slots untouched."""
    x, weight, bias, _, _, _ = _conv_inputs([1, 1, 1], 40, K, dtype, seed=K + 10, with_bias=with_bias)
    pool = torch.randn(6, 40, K - 1).to(DEVICE, dtype)
    slots = torch.tensor([4, 1, 3], device=DEVICE)
    pool_ref = pool.clone()
    out = causal_conv1d_update_slots(x, weight, bias, pool, slots)
    ref = conv1d.causal_conv1d_update_slots_ref(x, weight, bias, pool_ref, slots)
    assert_close(out, ref, dtype, "conv update slots")
    assert torch.equal(pool, pool_ref)
    assert torch.equal(pool[slots, :, -1], x.to(dtype))  # the newest column is this step's raw input


def test_conv_rejects_bad_shapes():
    x, weight, bias, init, qsl, token_req = _conv_inputs([2, 3], 40, 4, torch.float32, 0, True)
    with pytest.raises(ValueError, match="init_states"):
        causal_conv1d_varlen(x, weight, bias, init[:, :, :2], qsl, token_req)
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_update(x[:2], weight[:8], bias, init)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 64), (1, 2688)])
def test_rms_norm_matches_ref(shape, dtype):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(DEVICE, dtype)
    w = torch.randn(shape[-1], generator=g).to(DEVICE, dtype)
    assert_close(rms_norm(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,Di,group", [(5, 48, 12), (3, 64, 64), (4, 40, 10)])
def test_gated_rms_norm_matches_ref(T, Di, group, dtype):
    g = torch.Generator().manual_seed(Di)
    y = torch.randn(T, Di, generator=g).to(DEVICE)  # SSD output, fp32
    z = torch.randn(T, 2 * Di + 1, generator=g).to(DEVICE, dtype)[:, 1 : Di + 1]  # strided split of in_proj
    w = torch.randn(Di, generator=g).to(DEVICE, dtype)
    out = gated_group_rms_norm(y, z, w, group, 1e-5, dtype)
    assert out.dtype == dtype
    assert_close(out, norm.gated_group_rms_norm_ref(y, z, w, group, 1e-5, dtype), dtype, "gated_rms_norm")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conv_and_norms_gpu_nano_shapes(dtype):
    conv_dim, K = 64 * 64 + 2 * 8 * 128, 4
    args = _conv_inputs([2 * 128 + 3, 1, 1000, 2], conv_dim, K, dtype, seed=11, with_bias=True)
    assert_close(causal_conv1d_varlen(*args), conv1d.causal_conv1d_varlen_ref(*args), dtype, "conv varlen")
    x, weight, bias, init = args[0][:4], args[1], args[2], args[3]
    out, new = causal_conv1d_update(x, weight, bias, init)
    ref, new_ref = conv1d.causal_conv1d_update_ref(x, weight, bias, init)
    assert_close(out, ref, dtype, "conv update")
    assert torch.equal(new, new_ref)
    h = torch.randn(777, 2688, device=DEVICE).to(dtype)
    w = torch.randn(2688, device=DEVICE).to(dtype)
    assert_close(rms_norm(h, w, 1e-5), norm.rms_norm_ref(h, w, 1e-5), dtype, "rms_norm")
    y = torch.randn(777, 4096, device=DEVICE)
    z = torch.randn(777, 4096, device=DEVICE).to(dtype)
    wg = torch.randn(4096, device=DEVICE).to(dtype)
    assert_close(
        gated_group_rms_norm(y, z, wg, 512, 1e-5, dtype),
        norm.gated_group_rms_norm_ref(y, z, wg, 512, 1e-5, dtype),
        dtype,
        "gated_rms_norm",
    )
