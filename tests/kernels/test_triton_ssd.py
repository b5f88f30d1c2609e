"""Triton chunk-aligned varlen SSD and selective_state_update vs the torch references (and vs the recurrence)."""

from __future__ import annotations

import pytest
import torch

from service.engine.kernels import ssd
from service.engine.kernels.triton_ssd import (
    SSU_TILE_VARIANTS,
    SsuTiles,
    selective_state_update,
    selective_state_update_slots,
    selective_state_update_slots_raw_dt,
    ssd_varlen,
    ssu_tiles,
)
from tests.kernels.triton_test_util import DEVICE, assert_close, gpu, needs_cuda, rel_err


def _inputs(qlens, plens, H, P, G, N, chunk, dtype, seed):
    """Strided x/B/C views of one packed [T, H*P + 2*G*N + pad] buffer, like the mixer's split of in_proj."""
    g = torch.Generator().manual_seed(seed)
    T = sum(qlens)
    di, gn = H * P, G * N
    packed = torch.randn(T, di + 2 * gn + 3, generator=g).to(DEVICE, dtype)
    x = packed[:, :di].reshape(T, H, P)
    B = packed[:, di : di + gn].reshape(T, G, N)
    C = packed[:, di + gn : di + 2 * gn].reshape(T, G, N)
    dt = ssd.dt_softplus_clamp(
        torch.randn(T, H, generator=g).to(DEVICE) - 2.0, torch.randn(H, generator=g).to(DEVICE) * 0.5, (1e-3, 10.0)
    )
    A = -torch.exp(torch.rand(H, generator=g) * 2.5).to(DEVICE)
    D = torch.randn(H, generator=g).to(DEVICE, dtype)
    init = torch.randn(len(qlens), H, P, N, generator=g).to(DEVICE)
    layout = ssd.build_chunk_layout(qlens, plens, chunk, DEVICE)
    return x, dt, A, B, C, D, init, layout


def _check_ssd(qlens, plens, H, P, G, N, chunk, dtype, seed=0):
    args = _inputs(qlens, plens, H, P, G, N, chunk, dtype, seed)
    y, states = ssd_varlen(*args)
    y_ref, states_ref = ssd.ssd_varlen_ref(*args)
    assert y.dtype == states.dtype == torch.float32
    assert_close(y, y_ref, dtype, "y")
    assert_close(states, states_ref, dtype, "chunk_states")
    # every chunk end is on an absolute multiple of C, or is the request's last token
    layout = args[-1]
    first = layout.first_chunk.tolist()
    for i, (l, p) in enumerate(zip(qlens, plens)):
        for s in range((p // chunk + 1) * chunk, p + l + 1, chunk):
            k = ssd.snapshot_chunk_indices(layout, [i], [s], plens)[0]
            assert first[i] <= k < first[i] + layout.num_chunks[i].item()
            assert_close(states[k], states_ref[k], dtype, f"snapshot state of request {i} at {s}")


C_SMALL = 16
CPU_CASES = [
    ([2 * C_SMALL + 3, 3 * C_SMALL - 1, C_SMALL + 1], [0, 0, 0]),  # first request unaligned
    ([C_SMALL - 3, C_SMALL, 2 * C_SMALL + 1, 3 * C_SMALL - 1], [5, 0, C_SMALL + 3, 2 * C_SMALL - 1]),  # p % C != 0
    ([1, C_SMALL, 7, C_SMALL + 1], [C_SMALL - 1, 2 * C_SMALL, 0, 3]),  # < C, = C, k*C +- 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_ssd_varlen_matches_ref(case, dtype):
    qlens, plens = CPU_CASES[case]
    _check_ssd(qlens, plens, H=4, P=8, G=2, N=16, chunk=C_SMALL, dtype=dtype, seed=case)


def test_ssd_varlen_equals_token_recurrence():
    """Chunked scan == the one-token recurrence run token by token from the same initial state."""
    qlens, plens = [C_SMALL + 5, 9], [C_SMALL - 2, 3]
    x, dt, A, B, C, D, init, layout = _inputs(qlens, plens, 4, 8, 2, 16, C_SMALL, torch.float32, seed=7)
    y, states = ssd_varlen(x, dt, A, B, C, D, init, layout)
    start = 0
    for i, l in enumerate(qlens):
        state = init[i : i + 1]
        for t in range(start, start + l):
            yt, state = ssd.selective_state_update_ref(
                state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D
            )
            assert_close(y[t : t + 1], yt, torch.float32, f"y of token {t}")
        last = layout.first_chunk[i].item() + layout.num_chunks[i].item() - 1
        assert_close(states[last : last + 1], state, torch.float32, f"final state of request {i}")
        start += l


def test_ssd_varlen_rejects_bad_shapes():
    x, dt, A, B, C, D, init, layout = _inputs([5, 3], [0, 0], 4, 8, 2, 16, C_SMALL, torch.float32, seed=1)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_varlen(x, dt, A, B, C, D, init[:1], layout)
    with pytest.raises(ValueError, match="dt"):
        ssd_varlen(x, dt[:, :2], A, B, C, D, init, layout)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_varlen(x, dt, A, B, C, D, init.half(), layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selective_state_update_matches_ref(dtype):
    g = torch.Generator().manual_seed(3)
    Bq, H, P, G, N = 5, 4, 8, 2, 16
    packed = torch.randn(Bq, H * P + 2 * G * N, generator=g).to(DEVICE, dtype)
    x = packed[:, : H * P].reshape(Bq, H, P)
    Bm = packed[:, H * P : H * P + G * N].reshape(Bq, G, N)
    Cm = packed[:, H * P + G * N :].reshape(Bq, G, N)
    state = torch.randn(Bq, H, P, N, generator=g).to(DEVICE)
    dt = torch.rand(Bq, H, generator=g).to(DEVICE) * 0.2
    A = -torch.exp(torch.rand(H, generator=g)).to(DEVICE)
    D = torch.randn(H, generator=g).to(DEVICE, dtype)
    y, new = selective_state_update(state, x, dt, A, Bm, Cm, D)
    y_ref, new_ref = ssd.selective_state_update_ref(state, x, dt, A, Bm, Cm, D)
    assert_close(y, y_ref, dtype, "y")
    assert_close(new, new_ref, dtype, "new_state")


# ---------------- GPU: Nano-30B-A3B mamba shapes ----------------
NANO = dict(H=64, P=64, G=8, N=128, chunk=128)
GPU_CASES = [
    ([2 * 128 + 3, 3 * 128 - 1, 128 + 1, 1000, 5, 128], [0, 0, 0, 0, 0, 0]),
    ([127, 128, 129, 700, 1], [130, 64, 1, 255, 128 * 3 + 7]),
    ([8192], [0]),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", range(len(GPU_CASES)))
def test_ssd_varlen_gpu_nano_shapes(case, dtype):
    qlens, plens = GPU_CASES[case]
    _check_ssd(qlens, plens, dtype=dtype, seed=10 + case, **NANO)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selective_state_update_gpu(dtype):
    g = torch.Generator().manual_seed(5)
    Bq, H, P, G, N = 128, 64, 64, 8, 128
    x = torch.randn(Bq, H, P, generator=g).to(DEVICE, dtype)
    Bm, Cm = (torch.randn(Bq, G, N, generator=g).to(DEVICE, dtype) for _ in range(2))
    state = torch.randn(Bq, H, P, N, generator=g).to(DEVICE)
    dt = torch.rand(Bq, H, generator=g).to(DEVICE) * 0.2
    A, D = -torch.rand(H, generator=g).to(DEVICE), torch.randn(H, generator=g).to(DEVICE, dtype)
    y, new = selective_state_update(state, x, dt, A, Bm, Cm, D)
    y_ref, new_ref = ssd.selective_state_update_ref(state, x, dt, A, Bm, Cm, D)
    assert_close(y, y_ref, dtype, "y")
    assert_close(new, new_ref, dtype, "new_state")


def _check_ssu_slots(Bq, H, P, G, N, S, dtype, seed):
    """In-place pool update by slot id: touched slots advance, every other slot is left bit-identical."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(Bq, H, P, generator=g).to(DEVICE, dtype)
    Bm, Cm = (torch.randn(Bq, G, N, generator=g).to(DEVICE, dtype) for _ in range(2))
    dt = torch.rand(Bq, H, generator=g).to(DEVICE) * 0.2
    A, D = -torch.rand(H, generator=g).to(DEVICE), torch.randn(H, generator=g).to(DEVICE, dtype)
    pool = torch.randn(S, H, P, N, generator=g).to(DEVICE)
    slots = (torch.randperm(S - 1, generator=g)[:Bq] + 1).to(DEVICE)
    pool_ref = pool.clone()
    y = selective_state_update_slots(pool, slots, x, dt, A, Bm, Cm, D)
    y_ref = ssd.selective_state_update_slots_ref(pool_ref, slots, x, dt, A, Bm, Cm, D)
    y_next, _ = ssd.selective_state_update_ref(pool[slots], x, dt, A, Bm, Cm, D)
    assert_close(y, y_ref, dtype, "y")
    assert_close(pool[slots], pool_ref[slots], dtype, "pool[slots]")
    untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(pool[untouched], pool_ref[untouched])
    assert not torch.equal(y_next, y)  # the pool holds the advanced state: a second step differs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_selective_state_update_slots_matches_ref(dtype):
    _check_ssu_slots(Bq=5, H=4, P=8, G=2, N=16, S=9, dtype=dtype, seed=4)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selective_state_update_slots_gpu(dtype):
    _check_ssu_slots(Bq=64, H=64, P=64, G=8, N=128, S=80, dtype=dtype, seed=6)


# ---------------- decode step from the raw dt / A_log (softplus, clamp, -exp inside the kernel) ----------------
CLAMPS = [(0.0, float("inf")), (1e-3, float("inf")), (1e-2, 0.1), (1e-3, 1e9)]  # off, Nano's, both sides, tiny's


def _raw_dt_inputs(Bq, H, P, G, N, S, dtype, seed):
    """x/B/C/dt as strided splits of one in_proj-like row [x | B | C | dt | pad] in the model dtype."""
    g = torch.Generator().manual_seed(seed)
    di, gn = H * P, G * N
    packed = torch.randn(Bq, di + 2 * gn + H + 5, generator=g)
    packed[:, di + 2 * gn : di + 2 * gn + H] *= 12.0  # raw dt + bias spans softplus' regimes
    packed = packed.to(DEVICE, dtype)
    x = packed[:, :di].reshape(Bq, H, P)
    Bm = packed[:, di : di + gn].reshape(Bq, G, N)
    Cm = packed[:, di + gn : di + 2 * gn].reshape(Bq, G, N)
    dt = packed[:, di + 2 * gn : di + 2 * gn + H]
    dt_bias = (torch.randn(H, generator=g) * 2.0).to(DEVICE, dtype)
    A_log = (torch.rand(H, generator=g) * 2.5).to(DEVICE)
    D = torch.randn(H, generator=g).to(DEVICE, dtype)
    pool = torch.randn(S, H, P, N, generator=g).to(DEVICE)
    slots = (torch.randperm(S - 1, generator=g)[:Bq] + 1).to(DEVICE)
    return pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias


def _check_ssu_raw_dt(Bq, H, P, G, N, S, dtype, clamp, seed):
    pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias = _raw_dt_inputs(Bq, H, P, G, N, S, dtype, seed)
    assert dt.stride(-1) == 1 and dt.stride(0) > H  # a strided split, not a copy
    pool_ref, pool_old = pool.clone(), pool.clone()
    y = selective_state_update_slots_raw_dt(pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias, clamp)
    y_ref = ssd.selective_state_update_slots_raw_dt_ref(pool_ref, slots, x, dt, A_log, Bm, Cm, D, dt_bias, clamp)
    # the ref is the mixer's former decode path: torch dt/A preprocessing, then the slot step
    dt_f = ssd.dt_softplus_clamp(dt, dt_bias, clamp)
    y_old = ssd.selective_state_update_slots_ref(pool_old, slots, x, dt_f, -torch.exp(A_log.float()), Bm, Cm, D)
    assert torch.equal(y_ref, y_old) and torch.equal(pool_ref, pool_old)
    assert_close(y, y_ref, dtype, "y")
    assert_close(pool[slots], pool_ref[slots], dtype, "pool[slots]")
    untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(pool[untouched], pool_ref[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("clamp", CLAMPS)
def test_ssu_slots_raw_dt_matches_ref(clamp, dtype):
    _check_ssu_raw_dt(Bq=5, H=4, P=8, G=2, N=16, S=9, dtype=dtype, clamp=clamp, seed=8)


@pytest.mark.parametrize("clamp", CLAMPS)
def test_ssu_slots_raw_dt_softplus_per_element(clamp):
    """Zero state, x = B = 1: every new state element is the kernel's dt, compared one by one (fp32) with
    `dt_softplus_clamp` over raw values from -40 to 40 (log1p regime, exp regime, the threshold-20 branch)."""
    Bq, H, P, G, N = 6, 16, 4, 1, 16
    raw = torch.linspace(-40.0, 40.0, Bq * H).reshape(Bq, H).to(DEVICE)
    dt_bias = torch.zeros(H, device=DEVICE)
    pool = torch.zeros(Bq + 1, H, P, N, device=DEVICE)
    slots = torch.arange(1, Bq + 1, device=DEVICE)
    ones = torch.ones(Bq, G, N, device=DEVICE)
    selective_state_update_slots_raw_dt(
        pool,
        slots,
        torch.ones(Bq, H, P, device=DEVICE),
        raw,
        torch.zeros(H, device=DEVICE),
        ones,
        ones,
        torch.zeros(H, device=DEVICE),
        dt_bias,
        clamp,
    )
    got, want = pool[1:], ssd.dt_softplus_clamp(raw, dt_bias, clamp)[:, :, None, None].expand(Bq, H, P, N)
    rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel <= 1e-5, rel  # GPU exp/log are approximate (ex2/lg2.approx); a naive log(1 + exp(v)) fails


def test_ssu_slots_raw_dt_rejects_bad_shapes():
    pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias = _raw_dt_inputs(3, 4, 8, 2, 16, 6, torch.float32, seed=2)
    with pytest.raises(ValueError, match="dt_bias"):
        selective_state_update_slots_raw_dt(pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias[:3], (0.0, 1.0))
    with pytest.raises(ValueError, match="dt"):
        selective_state_update_slots_raw_dt(pool, slots, x, dt[:, :3], A_log, Bm, Cm, D, dt_bias, (0.0, 1.0))
    with pytest.raises(ValueError, match="A"):
        selective_state_update_slots_raw_dt(pool, slots, x, dt, A_log[:2], Bm, Cm, D, dt_bias, (0.0, 1.0))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clamp", CLAMPS)
def test_ssu_slots_raw_dt_gpu_nano_shapes(clamp, dtype):
    _check_ssu_raw_dt(Bq=64, H=64, P=64, G=8, N=128, S=80, dtype=dtype, clamp=clamp, seed=9)


# ---------------- state pools in bf16 / fp32 and the launch shapes of the decode step ----------------
def _check_ssu_pool_dtype(Bq, H, P, G, N, S, state_dtype, tiles, seed):
    """The pool in state_dtype: the kernel advances the state in fp32 and stores it rounded, as the reference does
    (fp32: within fp32 rounding; bf16: nearly every element the reference's bf16); untouched slots keep their
    bits; y matches the reference's y."""
    pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias = _raw_dt_inputs(Bq, H, P, G, N, S, torch.bfloat16, seed)
    pool = pool.to(state_dtype)
    pool_ref = pool.clone()
    clamp = (1e-3, float("inf"))
    y = selective_state_update_slots_raw_dt(pool, slots, x, dt, A_log, Bm, Cm, D, dt_bias, clamp, tiles)
    y_ref = ssd.selective_state_update_slots_raw_dt_ref(pool_ref, slots, x, dt, A_log, Bm, Cm, D, dt_bias, clamp)
    assert pool.dtype == state_dtype and not torch.isnan(pool).any()
    assert_close(y, y_ref, torch.float32, "y")
    if state_dtype == torch.float32:
        assert_close(pool[slots], pool_ref[slots], torch.float32, "pool[slots]")
    else:
        # the same fp32 values up to a few fp32 ulps (the GPU's exp and fused multiply-adds), so the same bf16 after
        # rounding to nearest except where a value sits on a rounding boundary
        assert rel_err(pool[slots], pool_ref[slots]) < 1e-3
        assert (pool[slots] == pool_ref[slots]).float().mean() > 0.98
    untouched = torch.ones(S, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(pool[untouched], pool_ref[untouched])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [SsuTiles(), SsuTiles(8, 2)])
def test_ssu_pool_dtypes_and_tiles_match_ref(state_dtype, tiles):
    _check_ssu_pool_dtype(Bq=5, H=4, P=16, G=2, N=16, S=9, state_dtype=state_dtype, tiles=tiles, seed=12)


def test_ssu_launch_shape_by_batch():
    """Small batches keep 16-row programs, large ones take whole 64-row heads; both are variants the GPU tests
    check, and the picked shape runs (here 130 requests, tiles left to the launcher)."""
    assert ssu_tiles(1) == ssu_tiles(127) == SsuTiles(16, 4)
    assert ssu_tiles(128) == ssu_tiles(1024) == SsuTiles(64, 4)
    assert {ssu_tiles(1), ssu_tiles(1024)} <= set(SSU_TILE_VARIANTS)
    _check_ssu_pool_dtype(Bq=130, H=2, P=64, G=1, N=16, S=140, state_dtype=torch.float32, tiles=None, seed=14)


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", SSU_TILE_VARIANTS)
def test_ssu_pool_dtypes_and_tiles_gpu_nano_shapes(state_dtype, tiles):
    _check_ssu_pool_dtype(Bq=300, H=64, P=64, G=8, N=128, S=400, state_dtype=state_dtype, tiles=tiles, seed=13)


def _check_ssd_bf16_states(qlens, plens, H, P, G, N, chunk, dtype, seed):
    """bf16 initial states: every chunk-end state is a bf16 value (rounded where a snapshot may store it), in the
    kernel as in the reference, and both agree within bf16 rounding (with fp32 operands mostly bit for bit)."""
    x, dt, A, B, C, D, init, layout = _inputs(qlens, plens, H, P, G, N, chunk, dtype, seed)
    init = init.to(torch.bfloat16)
    y, states = ssd_varlen(x, dt, A, B, C, D, init, layout)
    y_ref, states_ref = ssd.ssd_varlen_ref(x, dt, A, B, C, D, init, layout)
    for name, t in (("kernel", states), ("reference", states_ref)):
        assert torch.equal(t, t.to(torch.bfloat16).float()), f"{name} chunk states are not bf16 values"
    assert_close(y, y_ref, torch.bfloat16, "y")
    assert_close(states, states_ref, torch.bfloat16, "chunk_states")
    if dtype == torch.float32:  # bf16 operands: the kernel's bf16 dot products differ from the fp32 reference's
        assert (states == states_ref).float().mean() > 0.95
    fp32_states = ssd.ssd_varlen_ref(x, dt, A, B, C, D, init.float(), layout)[1]
    assert not torch.equal(fp32_states, states_ref)  # the rounding happened


@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_ssd_varlen_bf16_states_match_ref(case):
    qlens, plens = CPU_CASES[case]
    _check_ssd_bf16_states(qlens, plens, H=4, P=8, G=2, N=16, chunk=C_SMALL, dtype=torch.float32, seed=20 + case)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ssd_varlen_bf16_states_gpu_nano_shapes(dtype):
    qlens, plens = GPU_CASES[1]
    _check_ssd_bf16_states(qlens, plens, dtype=dtype, seed=30, **NANO)
