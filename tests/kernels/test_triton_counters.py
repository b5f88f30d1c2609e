"""Persistent arrival counters: the split-K GEMV and the multi-program router share one zeroed int32 buffer (the
triton bundle's `ArrivalCounters`), each launch leaves it zeroed, so no launch needs a counter memset."""

from __future__ import annotations

import pytest
import torch
import triton

from service.engine.kernels import moe
from service.engine.kernels.linear import gemv_ref
from service.engine.kernels.tiles import GemvTiles, RouteTiles, default_gemv_tiles, route_tiles
from service.engine.kernels.triton_backend import ARRIVAL_COUNTER_SLOTS, ArrivalCounters, triton_kernels
from service.engine.kernels.triton_common import TARGET_PROGRAMS
from service.engine.kernels.triton_gemv import gemv, linear
from service.engine.kernels.triton_moe_route import moe_route, moe_route_tiled
from tests.kernels.triton_test_util import DEVICE, gpu, needs_cuda

ROUTE_TILES = RouteTiles("fma", 4, 16, 16, 2, 2)  # T=7, E=64, d=100: 2 token blocks x 16 arrivals
GEMV_TILES = GemvTiles(8, 32, 4, True, 3)  # N=50, K=300: 7 column blocks x 3 splits


def _route_inputs(T, E, d, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g).to(DEVICE)
    gate = (torch.randn(E, d, generator=g) * d**-0.5).to(DEVICE)
    return h, gate, (torch.randn(E, generator=g) * 0.1).to(DEVICE)


def _gemv_inputs(M, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(DEVICE)
    return x, w, torch.randn(N, generator=g).to(DEVICE)


def _assert_route_ref(out, h, gate, bias, args):
    w_ref, ids_ref = moe.moe_route_ref(h, gate, bias, *args)
    assert torch.equal(out[1], ids_ref)
    torch.testing.assert_close(out[0], w_ref, rtol=1e-5, atol=1e-5)


def test_route_and_gemv_twice_share_one_persistent_buffer():
    """Route (2 token blocks, several programs each) and split-K GEMV, each twice in a row on one buffer: equal to
    the references every time, bit-equal to the fresh-counter launch, and the buffer all zero after each launch."""
    counters = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    h, gate, bias = _route_inputs(7, 64, 100, seed=1)
    x, w, b = _gemv_inputs(2, 50, 300, seed=2)
    args = (6, 4, 2, True, 2.5)
    fresh_route = moe_route_tiled(h, gate, bias, *args, ROUTE_TILES)
    fresh_gemv = gemv(x, w, b, GEMV_TILES)
    for _ in range(2):
        out = moe_route_tiled(h, gate, bias, *args, ROUTE_TILES, counters)
        assert not counters.any()
        _assert_route_ref(out, h, gate, bias, args)
        assert torch.equal(out[0], fresh_route[0]) and torch.equal(out[1], fresh_route[1])
        y = gemv(x, w, b, GEMV_TILES, counters)
        assert not counters.any()
        torch.testing.assert_close(y, gemv_ref(x, w, b), rtol=1e-5, atol=1e-5)
        assert torch.equal(y, fresh_gemv)


def test_default_route_and_gemv_with_counters():
    """The default launch shapes (decode router: expert slices x K slices; untuned GEMV shape: split-K) with a
    persistent buffer, as the bundle launches them."""
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    h, gate, bias = _route_inputs(1, 64, 48, seed=3)
    assert route_tiles(1, 64, 48, h.dtype).block_e < 64  # several programs per token block
    for _ in range(2):
        _assert_route_ref(moe_route(h, gate, bias, 6, 1, 1, True, 2.5, counters), h, gate, bias, (6, 1, 1, True, 2.5))
        assert not counters.any()
    x, w, b = _gemv_inputs(1, 50, 600, seed=4)
    assert default_gemv_tiles(50, 600).split_k > 1
    for _ in range(2):
        torch.testing.assert_close(linear(x, w, b, counters), gemv_ref(x, w, b), rtol=1e-5, atol=1e-5)
        assert not counters.any()


def test_too_small_or_malformed_counters_raise():
    h, gate, bias = _route_inputs(7, 64, 100, seed=5)
    x, w, b = _gemv_inputs(2, 50, 300, seed=6)
    small = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bad = [
        torch.zeros(16, dtype=torch.int64, device=DEVICE),
        torch.zeros(4, 4, dtype=torch.int32, device=DEVICE),
        torch.zeros(32, dtype=torch.int32, device=DEVICE)[::2],
    ]
    for c in [small] + bad:  # the route needs 2 counters (token blocks), the GEMV 7
        with pytest.raises(ValueError, match="counters"):
            moe_route_tiled(h, gate, bias, 6, 1, 1, True, 1.0, ROUTE_TILES, c)
        with pytest.raises(ValueError, match="counters"):
            gemv(x, w, b, GEMV_TILES, c)
    with pytest.raises(ValueError, match="counters needs >= 7"):
        gemv(x, w, b, GEMV_TILES, torch.zeros(6, dtype=torch.int32, device=DEVICE))


def test_bundle_routes_and_gemvs_use_its_counters(monkeypatch):
    """The triton bundle's linear and moe_route pass its one buffer per device (created once, zero, left zero)."""
    from service.engine.kernels import triton_gemv, triton_moe_route

    counters = ArrivalCounters()
    k = triton_kernels(counters)
    seen = []

    def spy(fn):
        return lambda *a, **kw: seen.append(kw["counters"]) or fn(*a, **kw)

    monkeypatch.setattr(triton_gemv, "linear", spy(triton_gemv.linear))
    monkeypatch.setattr(triton_moe_route, "moe_route", spy(triton_moe_route.moe_route))
    h, gate, bias = _route_inputs(1, 64, 48, seed=7)
    x, w, b = _gemv_inputs(1, 50, 600, seed=8)
    for _ in range(2):
        _assert_route_ref(k.moe_route(h, gate, bias, 6, 1, 1, True, 2.5), h, gate, bias, (6, 1, 1, True, 2.5))
        torch.testing.assert_close(k.linear(x, w, b), gemv_ref(x, w, b), rtol=1e-5, atol=1e-5)
    buf = counters.on(DEVICE)
    assert len(seen) == 4 and all(c is buf for c in seen)
    assert buf.shape == (ARRIVAL_COUNTER_SLOTS,) and buf.dtype == torch.int32 and not buf.any()


def test_counter_slots_cover_the_bundle_grids():
    """The sizing in ArrivalCounters' docstring: default GEMV tiles split K only with <= TARGET_PROGRAMS // 2
    column blocks; the router's token blocks fit for T up to 2^20."""
    for n in (1, 100, 1056, 1057, 4096, 2688, 10304, 131072):
        t = default_gemv_tiles(n, 2688)
        assert t.split_k == 1 or triton.cdiv(n, t.block_n) <= TARGET_PROGRAMS // 2 <= ARRIVAL_COUNTER_SLOTS, n
    for T in (1, 8, 9, 64, 65, 512, 513, 2**20):
        for dtype in (torch.bfloat16, torch.float32):
            assert triton.cdiv(T, route_tiles(T, 128, 2688, dtype).block_t) <= ARRIVAL_COUNTER_SLOTS, (T, dtype)


@gpu
@needs_cuda
def test_shared_counters_in_cuda_graph():
    """Two router launches and two split-K GEMVs (a dependent chain, PDL on Hopper) share the bundle's buffer in
    one CUDA graph: every replay on new inputs equals the eager chain bit for bit; the buffer stays zero. Creating
    the buffer inside a capture raises."""
    counters = ArrivalCounters()
    k = triton_kernels(counters)
    h0, gate, bias = _route_inputs(1, 128, 2688, seed=9)
    w1 = _gemv_inputs(1, 512, 2688, seed=10)[1]  # 64 column blocks: default split 4
    w2, gate2 = _gemv_inputs(1, 1024, 512, seed=11)[1], _route_inputs(1, 128, 512, seed=12)[1]
    assert default_gemv_tiles(512, 2688).split_k > 1 and default_gemv_tiles(1024, 512).split_k > 1

    def chain(h):
        r1 = k.moe_route(h, gate, bias, 6, 1, 1, True, 2.5)
        y1 = k.linear(h, w1)
        r2 = k.moe_route(y1, gate2, bias, 6, 8, 4, False, 2.5)
        return (*r1, *r2, k.linear(y1, w2))

    h = h0.clone()
    chain(h)  # compile and create the buffer outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(h)
    for seed in (13, 14, 15):
        h.copy_(_route_inputs(1, 128, 2688, seed=seed)[0])
        graph.replay()
        eager = chain(h.clone())
        assert all(torch.equal(o, e) for o, e in zip(outs, eager)), f"replay {seed} differs from the eager chain"
        assert not counters.on(DEVICE).any()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        torch.ones(1, device=DEVICE).add_(1)
        with pytest.raises(RuntimeError, match="capture"):
            ArrivalCounters().on(DEVICE)
