"""The compiled CPU kernels of the "native" bundle (csrc/cpu_decode.c via cpu_native_ops) against their `*_ref`
oracles over sizes, strides and dtypes (tails of the vector loops, GQA groups of 4 and not), the inputs each launcher
hands to the torch bundle instead, the bounds checks, the build (cache, compiler errors) and the bundle wiring."""

from __future__ import annotations

import os

import pytest
import torch

from service.engine.kernels import (
    attention,
    conv1d,
    cpu_attention,
    cpu_conv1d,
    cpu_moe,
    cpu_native,
    cpu_native_ops,
    cpu_norm,
    cpu_ssd,
    get_kernels,
    moe,
    norm,
    ssd,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude


def close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err


# ---------------------------------------------------------------- selective state update
@pytest.mark.parametrize("slots", [[2, 3, 4, 5], [6, 1, 3], [7]])
@pytest.mark.parametrize("sizes", [(4, 8, 2, 16), (8, 32, 2, 64), (3, 5, 1, 20)])  # (H, P, G, N): N with a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("clamp", [(0.0, float("inf")), (0.001, 0.5)])
def test_selective_state_update(slots, sizes, dtype, clamp):
    torch.manual_seed(2)
    H, P, G, N = sizes
    Bt = len(slots)
    pool = torch.randn(8, H, P, N)
    pool_ref = pool.clone()
    ids = torch.tensor(slots)
    xbc = torch.randn(Bt, H * P + 2 * G * N + 3, dtype=dtype)  # x, B, C as strided column slices, as the layer has
    x = xbc[:, : H * P].view(Bt, H, P)
    B = xbc[:, H * P : H * P + G * N].view(Bt, G, N)
    C = xbc[:, H * P + G * N : H * P + 2 * G * N].view(Bt, G, N)
    dt = torch.randn(Bt, 2 * H, dtype=dtype)[:, ::2]
    args = (x, dt, torch.randn(H), B, C, torch.randn(H), torch.randn(H), clamp)
    for _ in range(2):  # two steps: the second reads the state the first wrote
        y = cpu_native_ops.selective_state_update_slots_raw_dt(pool, ids, *args)
        y_ref = ssd.selective_state_update_slots_raw_dt_ref(pool_ref, ids, *args)
        close(y, y_ref, TOL[torch.float32])
        close(pool, pool_ref, TOL[torch.float32])
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(pool[untouched], pool_ref[untouched])


def test_selective_state_update_hands_other_inputs_to_the_torch_bundle(monkeypatch):
    """A bf16 pool and repeated slots (padding rows on the scratch slot) run cpu_ssd's op, which matches the
    reference there (tests/kernels/test_cpu_kernels.py)."""
    calls = []
    fast = cpu_ssd.selective_state_update_slots_raw_dt
    monkeypatch.setattr(cpu_ssd, "selective_state_update_slots_raw_dt", lambda *a: calls.append(1) or fast(*a))
    H, P, G, N = 2, 4, 1, 8
    args = (torch.randn(3, H, P), torch.randn(3, H), torch.randn(H), torch.randn(3, G, N))
    args += (torch.randn(3, G, N), torch.randn(H), torch.randn(H), (0.0, float("inf")))
    cpu_native_ops.selective_state_update_slots_raw_dt(
        torch.randn(5, H, P, N).bfloat16(), torch.tensor([1, 2, 3]), *args
    )
    cpu_native_ops.selective_state_update_slots_raw_dt(torch.randn(5, H, P, N), torch.tensor([0, 4, 0]), *args)
    assert len(calls) == 2


# ---------------------------------------------------------------- prefill scan
SSD_BATCHES = [  # (query_lens, prefix_lens): full chunks, unaligned prefixes, one-token requests, one long request
    ([32, 32], [0, 0]),
    ([40, 7, 16, 33], [0, 5, 16, 3]),
    ([1, 1, 1], [3, 20, 0]),
    ([1, 64, 1, 13], [30, 0, 7, 19]),
    ([70], [9]),
]


@pytest.mark.parametrize("lens", SSD_BATCHES)
@pytest.mark.parametrize("sizes", [(4, 8, 2, 16), (8, 32, 1, 64), (3, 5, 1, 20)])  # (H, P, G, N): N with a tail
def test_ssd_varlen(lens, sizes):
    """y at every token and the state at every chunk end against the chunked reference; x, B, C strided column
    slices of one row (as the layer's split gives)."""
    torch.manual_seed(5)
    ql, pl = lens
    H, P, G, N = sizes
    layout = ssd.build_chunk_layout(ql, pl, 16)
    T = sum(ql)
    xbc = torch.randn(T, H * P + 2 * G * N + 3)
    x = xbc[:, : H * P].view(T, H, P)
    B = xbc[:, H * P : H * P + G * N].view(T, G, N)
    C = xbc[:, H * P + G * N : H * P + 2 * G * N].view(T, G, N)
    dt = ssd.dt_softplus_clamp(torch.randn(T, H), torch.randn(H), (0.0, float("inf")))
    A, D = -torch.rand(H) - 0.2, torch.randn(H)
    init = torch.randn(len(ql), H, P, N)
    y, states = cpu_native_ops.ssd_varlen(x, dt, A, B, C, D, init, layout)
    y_ref, states_ref = ssd.ssd_varlen_ref(x, dt, A, B, C, D, init, layout)
    close(y, y_ref, TOL[torch.float32])
    close(states, states_ref, TOL[torch.float32])


def test_ssd_varlen_hands_bf16_states_to_the_torch_bundle(monkeypatch):
    """bf16 initial states (rounded at every chunk end) run cpu_ssd's scan, which matches the reference there
    (tests/kernels/test_cpu_kernels.py)."""
    calls = []
    fast = cpu_ssd.ssd_varlen
    monkeypatch.setattr(cpu_ssd, "ssd_varlen", lambda *a: calls.append(1) or fast(*a))
    layout = ssd.build_chunk_layout([5], [0], 16)
    args = (torch.randn(5, 2, 4), torch.rand(5, 2), -torch.rand(2), torch.randn(5, 1, 8), torch.randn(5, 1, 8))
    cpu_native_ops.ssd_varlen(*args, torch.randn(2), torch.randn(1, 2, 4, 8).bfloat16(), layout)
    cpu_native_ops.ssd_varlen(*args, torch.randn(2), torch.randn(1, 2, 4, 8), layout)
    assert len(calls) == 1


def test_ssd_varlen_checks_the_layout():
    args = (torch.randn(5, 2, 4), torch.rand(5, 2), -torch.rand(2), torch.randn(5, 1, 8), torch.randn(5, 1, 8))
    init = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="chunk layout"):  # a layout of 6 tokens over 5
        cpu_native_ops.ssd_varlen(*args, torch.randn(2), init, ssd.build_chunk_layout([6], [0], 16))
    with pytest.raises(ValueError, match="requests"):  # a layout of 2 requests, 1 initial state
        cpu_native_ops.ssd_varlen(*args, torch.randn(2), init, ssd.build_chunk_layout([3, 2], [0, 0], 16))


# ---------------------------------------------------------------- conv update
@pytest.mark.parametrize("slots", [[1, 2, 3], [5, 1, 7], [0]])
@pytest.mark.parametrize("kernel", [2, 4, 5])  # 4: the unrolled width-4 path; 2, 5: the generic loops
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update(slots, kernel, bias, dtype):
    """The pool in the model's dtype (bf16: the torch bundle's op, whose oracle agrees)."""
    torch.manual_seed(4)
    Dm = 37
    pool = torch.randn(9, Dm, kernel - 1, dtype=dtype)
    pool_ref = pool.clone()
    ids = torch.tensor(slots)
    w, b = torch.randn(Dm, kernel, dtype=dtype), torch.randn(Dm, dtype=dtype) if bias else None
    for _ in range(3):  # the state shifts: a few steps
        x = torch.randn(len(slots), Dm + 5, dtype=dtype)[:, :Dm]  # a strided column slice, as in_proj's split gives
        out = cpu_native_ops.causal_conv1d_update_slots(x, w, b, pool, ids)
        close(out, conv1d.causal_conv1d_update_slots_ref(x, w, b, pool_ref, ids), TOL[dtype])
        assert torch.equal(pool, pool_ref)


def test_conv_update_hands_other_inputs_to_the_torch_bundle(monkeypatch):
    calls = []
    fast = cpu_conv1d.causal_conv1d_update_slots
    monkeypatch.setattr(cpu_conv1d, "causal_conv1d_update_slots", lambda *a: calls.append(1) or fast(*a))
    x, w = torch.randn(3, 8), torch.randn(8, 4)
    cpu_native_ops.causal_conv1d_update_slots(x, w, None, torch.randn(5, 8, 3).bfloat16(), torch.tensor([1, 2, 3]))
    cpu_native_ops.causal_conv1d_update_slots(x, w, None, torch.randn(5, 8, 3), torch.tensor([0, 2, 0]))
    assert len(calls) == 2


def test_state_kernels_check_slots():
    x, w = torch.randn(2, 8), torch.randn(8, 4)
    with pytest.raises(ValueError, match="slot_ids"):
        cpu_native_ops.causal_conv1d_update_slots(x, w, None, torch.randn(5, 8, 3), torch.tensor([1, 5]))
    H, P, G, N = 2, 4, 1, 8
    args = (torch.randn(2, H, P), torch.randn(2, H), torch.randn(H), torch.randn(2, G, N))
    args += (torch.randn(2, G, N), torch.randn(H), torch.randn(H), (0.0, float("inf")))
    with pytest.raises(ValueError, match="slot_ids"):
        cpu_native_ops.selective_state_update_slots_raw_dt(torch.randn(5, H, P, N), torch.tensor([-1, 2]), *args)


# ---------------------------------------------------------------- prefill conv
@pytest.mark.parametrize("query_lens", [[40, 7, 1, 33], [1], [2, 3], [6, 6, 6]])  # requests shorter than K-1 too
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_varlen(query_lens, kernel, bias):
    torch.manual_seed(3)
    Dm, Bq, T = 37, len(query_lens), sum(query_lens)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist())
    token_req = torch.repeat_interleave(torch.arange(Bq), torch.tensor(query_lens))
    x = torch.randn(T, Dm + 9)[:, 4 : 4 + Dm]  # a strided column slice, as in_proj's split gives
    w, b = torch.randn(Dm, kernel), torch.randn(Dm) if bias else None
    states = torch.randn(Bq, Dm, kernel - 1)
    out = cpu_native_ops.causal_conv1d_varlen(x, w, b, states, qsl, token_req)
    close(out, conv1d.causal_conv1d_varlen_ref(x, w, b, states, qsl, token_req), TOL[torch.float32])


def test_conv_varlen_checks_query_start_loc():
    x, w, states = torch.randn(5, 8), torch.randn(8, 4), torch.randn(2, 8, 3)
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_native_ops.causal_conv1d_varlen(x, w, None, states, torch.tensor([0, 3, 6]), torch.zeros(5))


# ---------------------------------------------------------------- gated norm + linear
@pytest.mark.parametrize("rows", [1, 5, cpu_norm.NORM_BLOCK_ROWS + 44])  # one block; blocks and a partial one
@pytest.mark.parametrize("group_size", [16, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_gated_norm_linear(rows, group_size, bias):
    torch.manual_seed(7)
    Di, N = 64, 40
    y, z = torch.randn(rows, Di), torch.randn(rows, Di + 24)[:, 8 : 8 + Di]  # z strided, as in_proj's split gives
    args = (y, z, 1.0 + 0.1 * torch.randn(Di), group_size, 1e-5, torch.randn(N, Di), torch.randn(N) if bias else None)
    close(cpu_native_ops.gated_norm_linear(*args), norm.gated_norm_linear_ref(*args), TOL[torch.float32])


@pytest.mark.parametrize("rows", [1, 5, cpu_norm.NORM_BLOCK_ROWS + 44])
@pytest.mark.parametrize("bias", [True, False])
def test_add_rms_norm_and_linear(rows, bias):
    torch.manual_seed(8)
    K, N = 48, 24
    x, residual = torch.randn(rows, K + 8)[:, 8:], torch.randn(rows, K)  # x strided
    w = 1.0 + 0.1 * torch.randn(K)
    normed, new_res = cpu_native_ops.add_rms_norm(x, residual, w, 1e-5)
    normed_ref, new_res_ref = norm.add_rms_norm_ref(x, residual, w, 1e-5)
    assert torch.equal(new_res, new_res_ref)  # the fp32 add, rounded once, as the reference
    close(normed, normed_ref, TOL[torch.float32])
    args = (x, residual, w, 1e-5, torch.randn(N, K), torch.randn(N) if bias else None)
    y, new_res = cpu_native_ops.add_rms_norm_linear(*args)
    y_ref, new_res_ref = norm.add_rms_norm_linear_ref(*args)
    close(y, y_ref, TOL[torch.float32])
    assert torch.equal(new_res, new_res_ref)


def test_row_ops_hand_bf16_to_the_torch_bundle(monkeypatch):
    calls = []
    for mod, name in (
        (cpu_norm, "gated_norm_linear"),
        (cpu_conv1d, "causal_conv1d_varlen"),
        (cpu_norm, "add_rms_norm"),
        (cpu_norm, "add_rms_norm_linear"),
    ):
        fast = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fast=fast, name=name: calls.append(name) or fast(*a))
    y = torch.randn(3, 16).bfloat16()
    cpu_native_ops.gated_norm_linear(y, y, torch.ones(16), 8, 1e-5, torch.randn(4, 16).bfloat16(), None)
    qsl = torch.tensor([0, 3])
    cpu_native_ops.causal_conv1d_varlen(y, torch.randn(16, 4).bfloat16(), None, torch.randn(1, 16, 3).bfloat16(),
                                        qsl, torch.zeros(3, dtype=torch.int64))  # fmt: skip
    cpu_native_ops.add_rms_norm(y, y, torch.ones(16), 1e-5)
    cpu_native_ops.add_rms_norm_linear(y, y, torch.ones(16), 1e-5, torch.randn(4, 16).bfloat16())
    assert set(calls) == {"gated_norm_linear", "causal_conv1d_varlen", "add_rms_norm", "add_rms_norm_linear"}


# ---------------------------------------------------------------- paged attention
ATTN_BATCHES = [  # (query_lens, prefix_lens): decode only (unequal / equal contexts), mixed with prefill requests
    ([1, 1, 1], [12, 0, 70]),
    ([1, 1], [17, 17]),
    ([1, 5, 9, 3, 5], [12, 3, 0, 30, 3]),
    ([9, 9, 4], [0, 0, 0]),
]


@pytest.mark.parametrize("lens", ATTN_BATCHES)
@pytest.mark.parametrize("heads", [(8, 2, 32), (6, 2, 16), (4, 1, 24), (2, 2, 8)])  # (Hq, Hkv, Dh): GQA 4, 3, 4, 1
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_attention(lens, heads, page_size):
    torch.manual_seed(5)
    ql, pl = lens
    Hq, Hkv, Dh = heads
    max_len = 80
    pages_per_req = -(-max_len // page_size)
    num_pages = len(ql) * pages_per_req + 1
    kc, vc = torch.randn(num_pages * page_size, Hkv, Dh), torch.randn(num_pages * page_size, Hkv, Dh)
    page_table = (torch.randperm(num_pages - 1) + 1)[: len(ql) * pages_per_req].view(len(ql), pages_per_req)
    qsl = torch.tensor([0] + torch.tensor(ql).cumsum(0).tolist())
    qkv = torch.randn(sum(ql), Hq + 2 * Hkv, Dh)  # q as a strided view, as the layer passes it
    args = (qkv[:, :Hq], kc, vc, page_table, qsl, torch.tensor(pl), max(ql), max_len, page_size, Dh**-0.5)
    close(cpu_native_ops.paged_attention(*args), attention.paged_attention_ref(*args), TOL[torch.float32])


def test_paged_attention_hands_other_inputs_to_the_torch_bundle(monkeypatch):
    """bf16 and scaled (FP8) caches run cpu_attention's op."""
    calls = []
    fast = cpu_attention.paged_attention
    monkeypatch.setattr(cpu_attention, "paged_attention", lambda *a: calls.append(1) or fast(*a))
    kc = torch.randn(16, 1, 8)
    base = (torch.ones(1, 4, dtype=torch.int64) * torch.arange(4), torch.tensor([0, 1]), torch.tensor([5]), 1, 8, 4)
    cpu_native_ops.paged_attention(torch.randn(1, 2, 8).bfloat16(), kc.bfloat16(), kc.bfloat16(), *base, 0.3)
    scale = torch.tensor(1.0)
    cpu_native_ops.paged_attention(torch.randn(1, 2, 8), kc, kc, *base, 0.3, scale, scale)
    assert len(calls) == 2


def test_paged_attention_checks_pages():
    kc = torch.zeros(8, 1, 4)
    page_table = torch.tensor([[0, 7]])  # page 7 of a 2-page cache
    args = (torch.zeros(1, 1, 4), kc, kc, page_table, torch.tensor([0, 1]), torch.tensor([5]), 1, 8, 4, 1.0)
    with pytest.raises(ValueError, match="page_table"):
        cpu_native_ops.paged_attention(*args)


# ---------------------------------------------------------------- routed experts
@pytest.mark.parametrize("tokens, k", [(1, 4), (3, 2), (5, 4), (32, 4), (7, 1)])  # tiles of 4 full and partial
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("sizes", [(16, 32, 48), (4, 16, 32)])  # (E, I, d)
def test_moe_experts(tokens, k, shared, sizes):
    torch.manual_seed(6)
    E, I, d = sizes
    up, down = torch.randn(E, I, d) / d**0.5, torch.randn(E, d, I) / I**0.5
    x = torch.randn(tokens, d)
    weights, ids = torch.topk(torch.randn(tokens, E).softmax(-1), k)
    ids[0, -1] = ids[0, 0]  # the same expert picked twice by one token: both picks count
    sh = dict(shared_up=torch.randn(24, d) / d**0.5, shared_down=torch.randn(d, 24) / 24**0.5) if shared else {}
    ref = moe.moe_experts_ref(x, up, down, weights, ids, **sh)
    laid = cpu_native_ops.moe_weight_layout(up, down)
    assert cpu_native_ops._native_moe_layout(*laid)
    close(cpu_native_ops.moe_experts(x, *laid, weights, ids, **sh), ref, 1e-5)


def test_moe_experts_hands_other_inputs_to_the_torch_bundle(monkeypatch):
    """Weights not in the bundle's layout (as loaded; cpu_moe's), bf16, more picks than MOE_MAX_PAIRS, rows not
    16-float multiples: the torch bundle's op."""
    calls = []
    fast = cpu_moe.moe_experts
    monkeypatch.setattr(cpu_moe, "moe_experts", lambda *a, **kw: calls.append(1) or fast(*a, **kw))
    E, I, d = 4, 16, 32
    up, down = torch.randn(E, I, d), torch.randn(E, d, I)
    weights, ids = torch.topk(torch.randn(3, E).softmax(-1), 2)
    cpu_native_ops.moe_experts(torch.randn(3, d), up, down, weights, ids)  # as loaded
    cpu_native_ops.moe_experts(torch.randn(3, d), *cpu_moe.moe_weight_layout(up, down), weights, ids)
    laid = cpu_native_ops.moe_weight_layout(up, down)
    cpu_native_ops.moe_experts(torch.randn(3, d).bfloat16(), up.bfloat16(), down.bfloat16(), weights, ids)
    n = cpu_native_ops.MOE_MAX_PAIRS // 2 + 1
    big_w, big_ids = torch.topk(torch.randn(n, E).softmax(-1), 2)
    cpu_native_ops.moe_experts(torch.randn(n, d), *laid, big_w, big_ids)
    odd_up, odd_down = cpu_native_ops.moe_weight_layout(torch.randn(E, 12, d), torch.randn(E, d, 12))
    cpu_native_ops.moe_experts(torch.randn(3, d), odd_up, odd_down, weights, ids)
    assert len(calls) == 5
    cpu_native_ops.moe_experts(torch.randn(3, d), *laid, weights, ids)
    assert len(calls) == 5


def test_moe_experts_checks_ids():
    up, down = cpu_native_ops.moe_weight_layout(torch.randn(4, 16, 32), torch.randn(4, 32, 16))
    with pytest.raises(ValueError, match="topk_ids"):
        cpu_native_ops.moe_experts(torch.randn(2, 32), up, down, torch.ones(2, 1), torch.tensor([[1], [4]]))


# ---------------------------------------------------------------- router
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("experts, k", [(16, 4), (37, 6), (8, 8)])  # every expert picked too
@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_route(tokens, experts, k, norm_topk):
    """Same picks, in the same (descending) order, and weights as the reference."""
    torch.manual_seed(8)
    d = 48
    h, gate, bias = torch.randn(tokens + 3, d)[3:], torch.randn(experts, d) / d**0.5, 0.05 * torch.randn(experts)
    args = (h, gate, bias, k, 1, 1, norm_topk, 2.5)
    w, ids = cpu_native_ops.moe_route(*args)
    w_ref, ids_ref = moe.moe_route_ref(*args)
    assert torch.equal(ids, ids_ref)
    close(w, w_ref, 1e-6)


def test_moe_route_hands_other_inputs_to_the_reference(monkeypatch):
    """Group-limited routing (n_group > 1), bf16, and logits with a NaN (the reference ranks it first): the
    reference, whose answer the launcher returns."""
    calls = []
    ref = moe.moe_route_ref
    monkeypatch.setattr(cpu_native_ops, "moe_route_ref", lambda *a: calls.append(1) or ref(*a))
    h, gate, bias = torch.randn(5, 32), torch.randn(16, 32), torch.zeros(16)
    grouped = cpu_native_ops.moe_route(h, gate, bias, 4, 4, 2, True, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grouped, ref(h, gate, bias, 4, 4, 2, True, 1.0)))
    cpu_native_ops.moe_route(h.bfloat16(), gate.bfloat16(), bias, 4, 1, 1, True, 1.0)
    h[2, 0] = float("nan")
    _, ids = cpu_native_ops.moe_route(h, gate, bias, 4, 1, 1, True, 1.0)
    assert torch.equal(ids, ref(h, gate, bias, 4, 1, 1, True, 1.0)[1])
    assert len(calls) == 3
    cpu_native_ops.moe_route(torch.randn(5, 32), gate, bias, 4, 1, 1, True, 1.0)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="top_k"):
        cpu_native_ops.moe_route(h, gate, bias, 17, 1, 1, True, 1.0)


# ---------------------------------------------------------------- build and bundle
def test_build_is_cached_and_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRID_SERVE_NATIVE_CACHE", str(tmp_path))
    path = cpu_native.library_path()  # compiled into the empty cache
    assert path.parent.parent == tmp_path and path.exists()
    built = os.stat(path).st_mtime_ns
    assert cpu_native.library_path() == path and os.stat(path).st_mtime_ns == built  # found, not rebuilt
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HYBRID_SERVE_NATIVE_CACHE", str(tmp_path / "file" / "cache"))  # not a folder it can create
    with pytest.raises(cpu_native.NativeBuildError, match="HYBRID_SERVE_NATIVE_CACHE"):
        cpu_native.library_path()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(cpu_native.NativeBuildError, match="kernel_backend='torch'"):
        cpu_native.library_path()


def test_native_bundle_runs_the_compiled_kernels():
    native, fast = get_kernels("native"), get_kernels("torch")
    assert native.name == "native"
    assert native.selective_state_update_slots_raw_dt is cpu_native_ops.selective_state_update_slots_raw_dt
    assert native.conv_update_slots is cpu_native_ops.causal_conv1d_update_slots
    assert native.paged_attention is cpu_native_ops.paged_attention
    assert native.conv_varlen is cpu_native_ops.causal_conv1d_varlen
    assert native.gated_norm_linear is cpu_native_ops.gated_norm_linear
    assert native.add_rms_norm is cpu_native_ops.add_rms_norm
    assert native.add_rms_norm_linear is cpu_native_ops.add_rms_norm_linear
    assert native.ssd_varlen is cpu_native_ops.ssd_varlen
    assert fast.ssd_varlen is cpu_ssd.ssd_varlen
    assert native.mamba_decode_split and fast.mamba_decode_split
    assert native.moe_experts is cpu_native_ops.moe_experts
    assert native.moe_weight_layout is cpu_native_ops.moe_weight_layout
    assert native.moe_route is cpu_native_ops.moe_route


def test_moe_weight_layout_serves_the_prefill_path_too():
    """The bundle's expert layout: same values; the torch bundle's grouped GEMMs (prefill sizes) read it as is."""
    up, down = torch.randn(4, 16, 32), torch.randn(4, 32, 16)
    lu, ld = cpu_native_ops.moe_weight_layout(up, down)
    assert torch.equal(lu, up) and torch.equal(ld, down)
    assert cpu_moe._operand(lu.transpose(1, 2)).data_ptr() == lu.data_ptr()  # no copy
    assert cpu_moe._operand(ld.transpose(1, 2)).data_ptr() == ld.data_ptr()
    x = torch.randn(300, 32)
    weights, ids = torch.topk(torch.randn(300, 4).softmax(-1), 2)  # 600 picks: the torch bundle's op
    close(cpu_native_ops.moe_experts(x, lu, ld, weights, ids), moe.moe_experts_ref(x, up, down, weights, ids), 1e-5)
