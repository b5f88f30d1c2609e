"""The fast pure-torch kernels of the `torch` bundle (cpu_*.py) against their `*_ref` oracles, over sizes, layouts
and dtypes; and the bundle wiring."""

from __future__ import annotations

import math

import pytest
import torch

from service.engine.kernels import (
    attention,
    conv1d,
    cpu_attention,
    cpu_conv1d,
    cpu_linear,
    cpu_moe,
    cpu_norm,
    cpu_ssd,
    get_kernels,
    linear,
    moe,
    norm,
    ssd,
    torch_reference_kernels,
)

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


# ---------------------------------------------------------------- SSD
SSD_BATCHES = [  # (query_lens, prefix_lens): full chunks only, unaligned prefixes, one-token requests, mixed
    ([32, 32], [0, 0]),
    ([40, 7, 16, 33], [0, 5, 16, 3]),
    ([1, 1, 1], [3, 20, 0]),
    ([70], [9]),
]


@pytest.mark.parametrize("lens", SSD_BATCHES)
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_chunks", [cpu_ssd.SSD_BLOCK_CHUNKS, 2])  # the batch in one group; groups of requests
def test_ssd_varlen(lens, groups, dtype, block_chunks, monkeypatch):
    monkeypatch.setattr(cpu_ssd, "SSD_BLOCK_CHUNKS", block_chunks)
    torch.manual_seed(1)
    ql, pl = lens
    H, P, N, C = 4, 8, 16, 16
    layout = ssd.build_chunk_layout(ql, pl, C)
    T = sum(ql)
    x, B, Cm = (
        torch.randn(T, H, P, dtype=dtype),
        torch.randn(T, groups, N, dtype=dtype),
        torch.randn(T, groups, N, dtype=dtype),
    )
    dt = ssd.dt_softplus_clamp(torch.randn(T, H), torch.randn(H), (0.0, math.inf))
    A, D = -torch.rand(H) - 0.2, torch.randn(H)
    init = torch.randn(len(ql), H, P, N)
    y, states = cpu_ssd.ssd_varlen(x, dt, A, B, Cm, D, init, layout)
    y_ref, states_ref = ssd.ssd_varlen_ref(x, dt, A, B, Cm, D, init, layout)
    close(y, y_ref, torch.float32)
    close(states, states_ref, torch.float32)


@pytest.mark.parametrize("lens", SSD_BATCHES)
def test_ssd_varlen_bf16_states(lens):
    """bf16 initial states (the mamba_ssm_cache_dtype bfloat16 pools): every chunk-end state is rounded to bf16,
    as the reference does."""
    torch.manual_seed(3)
    ql, pl = lens
    H, P, N, C = 4, 8, 16, 16
    layout = ssd.build_chunk_layout(ql, pl, C)
    T = sum(ql)
    x, B, Cm = torch.randn(T, H, P), torch.randn(T, 2, N), torch.randn(T, 2, N)
    dt = ssd.dt_softplus_clamp(torch.randn(T, H), torch.randn(H), (0.0, math.inf))
    A, D = -torch.rand(H) - 0.2, torch.randn(H)
    init = torch.randn(len(ql), H, P, N).to(torch.bfloat16)
    y, states = cpu_ssd.ssd_varlen(x, dt, A, B, Cm, D, init, layout)
    y_ref, states_ref = ssd.ssd_varlen_ref(x, dt, A, B, Cm, D, init, layout)
    assert torch.equal(states, states.to(torch.bfloat16).float())
    close(y, y_ref, torch.bfloat16)
    close(states, states_ref, torch.bfloat16)
    assert (states == states_ref).float().mean() > 0.95


@pytest.mark.parametrize("slots", [[2, 3, 4, 5], [6, 1, 3, 2], [0, 4, 0, 0]])  # one run, scattered, padding on 0
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_state_update_slots(slots, dtype):
    torch.manual_seed(2)
    H, P, G, N, Bt = 4, 8, 2, 16, len(slots)
    pool = torch.randn(8, H, P, N)
    pool_ref = pool.clone()
    ids = torch.tensor(slots)
    x, dt = torch.randn(Bt, H, P, dtype=dtype), torch.randn(Bt, 2 * H, dtype=dtype)[:, ::2]  # dt strided
    B, C = torch.randn(Bt, G, N, dtype=dtype), torch.randn(Bt, G, N, dtype=dtype)
    args = (x, dt, torch.randn(H), B, C, torch.randn(H), torch.randn(H), (0.001, 5.0))
    y = cpu_ssd.selective_state_update_slots_raw_dt(pool, ids, *args)
    y_ref = ssd.selective_state_update_slots_raw_dt_ref(pool_ref, ids, *args)
    close(y, y_ref, torch.float32)  # every row reads its slot's state from before the step
    written = sorted({s for s in slots if slots.count(s) == 1})  # padding rows sharing slot 0 leave it undefined
    close(pool[written], pool_ref[written], torch.float32)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(pool[untouched], pool_ref[untouched])


@pytest.mark.parametrize("slots", [[2, 3, 4, 5], [6, 1, 3, 2]])
def test_selective_state_update_slots_bf16_pool(slots):
    """A bf16 state pool: advanced in fp32, stored rounded to nearest, as the reference does."""
    torch.manual_seed(4)
    H, P, G, N, Bt = 4, 8, 2, 16, len(slots)
    pool = torch.randn(8, H, P, N).to(torch.bfloat16)
    pool_ref = pool.clone()
    ids = torch.tensor(slots)
    args = (torch.randn(Bt, H, P), torch.randn(Bt, H), torch.randn(H), torch.randn(Bt, G, N))
    args += (torch.randn(Bt, G, N), torch.randn(H), torch.randn(H), (0.001, 5.0))
    y = cpu_ssd.selective_state_update_slots_raw_dt(pool, ids, *args)
    y_ref = ssd.selective_state_update_slots_raw_dt_ref(pool_ref, ids, *args)
    close(y, y_ref, torch.float32)
    assert pool.dtype == torch.bfloat16 and (pool[ids] == pool_ref[ids]).float().mean() > 0.99
    close(pool[ids].float(), pool_ref[ids].float(), torch.bfloat16)


def test_ascending_run():
    assert cpu_ssd.ascending_run(torch.tensor([3, 4, 5])) == 3
    assert cpu_ssd.ascending_run(torch.tensor([5, 4, 3])) is None
    assert cpu_ssd.ascending_run(torch.tensor([1, 3])) is None


# ---------------------------------------------------------------- conv1d
@pytest.mark.parametrize("query_lens", [[40, 7, 1, 33], [1], [5, 5], [6, 6, 6]])  # unequal; equal lengths
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [cpu_conv1d.CONV_BLOCK_ROWS, 5])  # one block; blocks splitting requests
def test_conv_varlen(query_lens, kernel, bias, dtype, block_rows, monkeypatch):
    monkeypatch.setattr(cpu_conv1d, "CONV_BLOCK_ROWS", block_rows)
    torch.manual_seed(3)
    Dm, Bq, T = 24, len(query_lens), sum(query_lens)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist())
    token_req = torch.repeat_interleave(torch.arange(Bq), torch.tensor(query_lens))
    x, w = torch.randn(T, Dm, dtype=dtype), torch.randn(Dm, kernel, dtype=dtype)
    b = torch.randn(Dm, dtype=dtype) if bias else None
    states = torch.randn(Bq, Dm, kernel - 1, dtype=dtype)
    out = cpu_conv1d.causal_conv1d_varlen(x, w, b, states, qsl, token_req)
    close(out, conv1d.causal_conv1d_varlen_ref(x, w, b, states, qsl, token_req), dtype)


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_state_windows(kernel, dtype):
    """States after 0, 1, some and all new tokens of each request, fewer and more tokens than K-1."""
    torch.manual_seed(8)
    query_lens, Dm = [6, 1, 9], 24
    T, Bq = sum(query_lens), len(query_lens)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist())
    x, states = torch.randn(T, Dm, dtype=dtype), torch.randn(Bq, Dm, kernel - 1, dtype=dtype)
    req = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    new = torch.tensor([0, 1, 2, 6, 0, 1, 3, 8, 9])
    out = cpu_conv1d.conv_state_windows(x, states, qsl, req, new)
    assert torch.equal(out, conv1d.conv_state_windows_ref(x, states, qsl, req, new))


@pytest.mark.parametrize("slots", [[1, 2, 3], [5, 1, 7]])
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_slots(slots, kernel, dtype):
    torch.manual_seed(4)
    Dm = 24
    pool = torch.randn(9, Dm, kernel - 1, dtype=dtype)
    pool_ref = pool.clone()
    ids = torch.tensor(slots)
    x, w, b = (
        torch.randn(len(slots), Dm, dtype=dtype),
        torch.randn(Dm, kernel, dtype=dtype),
        torch.randn(Dm, dtype=dtype),
    )
    for _ in range(3):  # the state shifts: a few steps
        out = cpu_conv1d.causal_conv1d_update_slots(x, w, b, pool, ids)
        close(out, conv1d.causal_conv1d_update_slots_ref(x, w, b, pool_ref, ids), dtype)
        assert torch.equal(pool, pool_ref)
        x = torch.randn_like(x)


# ---------------------------------------------------------------- attention
ATTN_BATCHES = [  # (query_lens, prefix_lens): decode only (unequal / equal contexts), prefill only (equal groups), mixed
    ([1, 1, 1], [12, 0, 30]),
    ([1, 1], [17, 17]),
    ([9, 9, 4], [0, 0, 0]),
    ([1, 5, 9, 3, 5], [12, 3, 0, 30, 3]),
    ([6, 6], [0, 0]),  # one group that is the whole step in order (views, no gather), without and with a prefix
    ([5, 5, 5], [3, 3, 3]),
    ([1] * 10 + [4] + [1] * 8, list(range(10)) + [2] + [30] * 8),  # decode groups of DECODE_ROWS, around a prefill
]


@pytest.mark.parametrize("lens", ATTN_BATCHES)
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention(lens, heads, page_size, dtype):
    torch.manual_seed(5)
    ql, pl = lens
    Hq, Hkv = heads
    Dh, pages_per_req = 16, -(-40 // page_size)
    num_pages = len(ql) * pages_per_req + 1
    kc = torch.randn(num_pages * page_size, Hkv, Dh, dtype=dtype)
    vc = torch.randn(num_pages * page_size, Hkv, Dh, dtype=dtype)
    page_table = (torch.randperm(num_pages - 1) + 1)[: len(ql) * pages_per_req].view(len(ql), pages_per_req)
    qsl = torch.tensor([0] + torch.tensor(ql).cumsum(0).tolist())
    qkv = torch.randn(sum(ql), Hq + 2 * Hkv, Dh, dtype=dtype)  # q as a strided view, as the layer passes it
    args = (qkv[:, :Hq], kc, vc, page_table, qsl, torch.tensor(pl), max(ql), 40, page_size, Dh**-0.5)
    close(cpu_attention.paged_attention(*args), attention.paged_attention_ref(*args), dtype)


def test_paged_attention_checks_bounds():
    kc = torch.zeros(8, 1, 4)
    args = (torch.zeros(3, 1, 4), kc, kc, torch.ones(1, 2, dtype=torch.int64), torch.tensor([0, 3]), torch.tensor([0]))
    with pytest.raises(ValueError, match="max_query_len"):
        cpu_attention.paged_attention(*args, 2, 8, 4, 1.0)


# ---------------------------------------------------------------- MoE
@pytest.mark.parametrize(
    "tokens, k, shared",
    [(1, 4, True), (2, 4, False), (5, 2, True), (5, 4, False), (64, 2, False), (300, 4, True), (2100, 2, True)],
)  # 1-2 tokens: pair by pair; 5 tokens: dense (fp32), rows (bf16); 64, 300 tokens: rows; 2100: rows in two blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [moe.moe_weight_layout_ref, cpu_moe.moe_weight_layout])  # as loaded; the bundle's
def test_moe_experts(tokens, k, shared, dtype, layout):
    torch.manual_seed(6)
    E, I, d, S = 8, 24, 32, 20
    up, down = torch.randn(E, I, d, dtype=dtype) / 6, torch.randn(E, d, I, dtype=dtype) / 5
    up, down = layout(up, down)
    x = torch.randn(tokens, d, dtype=dtype)
    weights, ids = moe.moe_route_ref(x, torch.randn(E, d), 0.1 * torch.randn(E), k, 1, 1, True, 2.5)
    kw = (
        dict(shared_up=torch.randn(S, d, dtype=dtype) / 6, shared_down=torch.randn(d, S, dtype=dtype) / 5)
        if shared
        else {}
    )
    out = cpu_moe.moe_experts(x, up, down, weights, ids, **kw)
    close(out, moe.moe_experts_ref(x, up, down, weights, ids, **kw), dtype)


def test_moe_weight_layout():
    """The bundle's layout stores up as [d, E, I] and down as [E, I, d] (row-major, seen through [E, I, d] / [E, d, I]
    views) with the same values; the reference layout makes any layout row-major again. The linears' layout stores
    a weight transposed."""
    up, down = torch.randn(3, 8, 4), torch.randn(3, 4, 8)
    up2, down2 = cpu_moe.moe_weight_layout(up, down)
    assert torch.equal(up2, up) and up2.permute(2, 0, 1).is_contiguous()
    assert torch.equal(down2, down) and down2.transpose(1, 2).is_contiguous()
    up3, down3 = moe.moe_weight_layout_ref(up2, down2)
    assert up3.is_contiguous() and down3.is_contiguous() and torch.equal(up3, up) and torch.equal(down3, down)
    w = torch.randn(5, 3)
    w2 = cpu_linear.linear_weight_layout(w)
    assert torch.equal(w2, w) and w2.t().is_contiguous() and linear.linear_weight_layout_ref(w) is w
    bf16 = w.to(torch.bfloat16)  # not measured: as loaded
    assert cpu_linear.linear_weight_layout(bf16) is bf16
    assert cpu_moe.moe_weight_layout(up.bfloat16(), down.bfloat16())[1].is_contiguous()


def test_moe_experts_unused_experts_and_every_layout():
    """Every token on the same 2 of 8 experts (six idle experts); the same pairs through every way (3 tokens: pair by
    pair; 5: dense, 10 pairs for 8 experts; 40: rows; and rows in two blocks)."""
    torch.manual_seed(7)
    E, I, d = 8, 16, 16
    up, down = cpu_moe.moe_weight_layout(torch.randn(E, I, d), torch.randn(E, d, I))
    for tokens in (3, 5, 40, cpu_moe.ROWS_BLOCK_TOKENS + 5):
        x = torch.randn(tokens, d)
        ids = torch.tensor([[5, 2]]).repeat(tokens, 1)
        w = torch.rand(tokens, 2)
        close(cpu_moe.moe_experts(x, up, down, w, ids), moe.moe_experts_ref(x, up, down, w, ids), torch.float32)


def test_moe_experts_repeated_picks_with_zero_weight():
    """Expert parallelism hands the op another rank's picks as weight 0 on local expert 0, so an expert can appear
    several times in a token's picks (one real pick among zeros): every layout sums them as the reference does."""
    torch.manual_seed(9)
    E, I, d = 4, 16, 16
    up, down = torch.randn(E, I, d), torch.randn(E, d, I)
    for tokens in (1, 3, 40):  # pair by pair, dense, rows
        x = torch.randn(tokens, d)
        ids = torch.tensor([[0, 0, 3, 0]]).repeat(tokens, 1)
        w = torch.tensor([[0.7, 0.0, 0.2, 0.0]]).repeat(tokens, 1)
        close(cpu_moe.moe_experts(x, up, down, w, ids), moe.moe_experts_ref(x, up, down, w, ids), torch.float32)


def test_moe_experts_checks_shared_expert():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="shared_up"):
        cpu_moe.moe_experts(
            x,
            torch.zeros(2, 3, 4),
            torch.zeros(2, 4, 3),
            torch.ones(2, 1),
            torch.zeros(2, 1, dtype=torch.int64),
            shared_up=torch.zeros(5, 4),
        )


# ---------------------------------------------------------------- norms
@pytest.mark.parametrize("rows", [5, 2 * cpu_norm.NORM_BLOCK_ROWS + 7])  # one block (the reference); three blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_norms(rows, dtype, bias):
    """The row-blocked norms are the reference's math per block: bit-equal norms, the fused linears within the
    tolerance (one GEMM per block)."""
    torch.manual_seed(8)
    d, Di, N, group = 32, 48, 40, 16
    x, res = torch.randn(rows, d, dtype=dtype), torch.randn(rows, d, dtype=dtype)
    nw, gw = 1 + 0.1 * torch.randn(d, dtype=dtype), 1 + 0.1 * torch.randn(Di, dtype=dtype)
    w_in, w_out = cpu_linear.linear_weight_layout(torch.randn(N, d, dtype=dtype)), torch.randn(N, Di, dtype=dtype)
    b = torch.randn(N, dtype=dtype) if bias else None
    y, z = torch.randn(rows, Di, dtype=dtype), torch.randn(rows, Di, dtype=dtype)
    assert torch.equal(cpu_norm.rms_norm(x, nw, 1e-5), norm.rms_norm_ref(x, nw, 1e-5))
    for out, ref in zip(cpu_norm.add_rms_norm(x, res, nw, 1e-5), norm.add_rms_norm_ref(x, res, nw, 1e-5)):
        assert torch.equal(out, ref)
    got, ref = (
        cpu_norm.add_rms_norm_linear(x, res, nw, 1e-5, w_in, b),
        norm.add_rms_norm_linear_ref(x, res, nw, 1e-5, w_in, b),
    )
    close(got[0], ref[0], dtype)
    assert torch.equal(got[1], ref[1])
    close(
        cpu_norm.gated_norm_linear(y, z, gw, group, 1e-5, w_out, b),
        norm.gated_norm_linear_ref(y, z, gw, group, 1e-5, w_out, b),
        dtype,
    )


# ---------------------------------------------------------------- bundle
def test_torch_bundle_runs_the_fast_kernels():
    fast, ref = get_kernels("torch"), torch_reference_kernels()
    assert fast.name == ref.name == "torch"
    assert fast.ssd_varlen is cpu_ssd.ssd_varlen and ref.ssd_varlen is ssd.ssd_varlen_ref
    assert fast.selective_state_update_slots_raw_dt is cpu_ssd.selective_state_update_slots_raw_dt
    assert fast.conv_varlen is cpu_conv1d.causal_conv1d_varlen
    assert fast.conv_update_slots is cpu_conv1d.causal_conv1d_update_slots
    assert fast.conv_windows is cpu_conv1d.conv_state_windows
    assert fast.paged_attention is cpu_attention.paged_attention
    assert fast.moe_experts is cpu_moe.moe_experts and ref.moe_experts is moe.moe_experts_ref
    assert fast.moe_weight_layout is cpu_moe.moe_weight_layout and ref.moe_weight_layout is moe.moe_weight_layout_ref
    assert fast.linear_weight_layout is cpu_linear.linear_weight_layout
    assert fast.gated_norm_linear is cpu_norm.gated_norm_linear and ref.gated_norm_linear is norm.gated_norm_linear_ref
    assert fast.add_rms_norm_linear is cpu_norm.add_rms_norm_linear and fast.add_rms_norm is cpu_norm.add_rms_norm
    assert fast.rms_norm is cpu_norm.rms_norm
    assert ref.linear_weight_layout is linear.linear_weight_layout_ref
