"""benchmarks/step_split.py: kernel families by name, the per-step split of a Chrome trace (device time per family,
busy union, host gaps), and the decode-step bound, each against numbers worked out by hand."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import step_split


def test_families_of_the_engine_kernels():
    cases = {
        "_ssu_kernel": "ssu",
        "_conv_update_kernel": "conv",
        "_decode_kernel": "attention",
        "_write_kv_kernel": "attention",
        "_up_kernel": "moe",
        "_moe_route_kernel": "moe",
        "_gemv_kernel": "gemm",
        "_norm_gemv_kernel": "gemm",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
        "_add_rms_norm_kernel": "norm",
        "_gated_rms_norm_kernel": "norm",
        "_chunk_scan_kernel": "ssd",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "copy",
        "void at::native::reduce_kernel<512, 1, at::native::ArgMaxOps<float>>": "other",
    }
    assert {name: step_split.family(name) for name in cases} == cases


def _x(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_split_of_two_steps_by_hand():
    """Three profiled ranges, so two steps over [1000, 1400) us: the window starts where the first range ends (the
    device work before it belongs to steps launched before profiling). Device work (overlap counted once in the
    busy union): ssu [1000, 1100), gemm [1050, 1150) (overlaps the ssu by 50), copy [1200, 1210), a kernel ending
    at 1020 (its part inside the window counts), one inside the first range and one after the window (left out)."""
    trace = {
        "traceEvents": [
            _x(step_split.STEP_RANGE, 900, 100, "user_annotation"),
            _x(step_split.STEP_RANGE, 1000, 150, "user_annotation"),
            _x(step_split.STEP_RANGE, 1150, 250, "user_annotation"),
            # the profiler's GPU-timeline copies of the two ranges: not steps of their own
            _x(step_split.STEP_RANGE, 1000, 150, "gpu_user_annotation"),
            _x(step_split.STEP_RANGE, 1150, 250, "gpu_user_annotation"),
            _x("_ssu_kernel", 1000, 100),
            _x("nvjet_tst_64x8", 1050, 100),
            _x("Memcpy HtoD (Pinned -> Device)", 1200, 10, "gpu_memcpy"),
            _x("_decode_kernel", 990, 30),
            _x("_gemv_kernel", 1500, 40),
            _x("_gemv_kernel", 920, 40),
            {"ph": "i", "name": "marker", "ts": 1100},
        ]
    }
    s = step_split.split_trace(trace)
    # busy: [990->1000, 1150) = 150 us, [1200, 1210) = 10 us -> 160 us over 2 steps = 0.08 ms; wall 400 us / 2
    assert s.steps == 2 and s.wall_ms == pytest.approx(0.2) and s.busy_ms == pytest.approx(0.08)
    assert s.idle_ms == pytest.approx(0.12)
    assert s.family_ms == pytest.approx({"ssu": 0.05, "gemm": 0.05, "copy": 0.005, "attention": 0.01})
    assert s.kernels_per_step == 2.0
    with pytest.raises(ValueError, match="two or more"):
        step_split.split_trace({"traceEvents": [_x("_ssu_kernel", 0, 1)]})
    with pytest.raises(ValueError, match="has 1"):
        step_split.split_trace({"traceEvents": [_x(step_split.STEP_RANGE, 0, 5, "user_annotation")]})


def test_split_of_a_real_profiler_trace(tmp_path):
    """torch.profiler's own Chrome trace on the CPU (no device events): the steps are found, nothing is busy."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            with torch.profiler.record_function(step_split.STEP_RANGE):
                torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    s = step_split.split_trace(json.loads(path.read_text()))
    assert s.steps == 2 and s.wall_ms > 0 and s.busy_ms == 0 and s.family_ms == {}


def test_decode_bound_by_hand():
    """Nano-like numbers: 3 GB dense + 60 GB experts (bf16), top 6 of 128, 48 MB of state per request, 6 KB of KV
    per token, context 1023, batch 1024, 4,000 GB/s and 600 TFLOP/s."""
    b = step_split.decode_bound(1024, 3e9, 60e9, 2, 6, 128, 48e6, 6e3, 1023, 4000.0, 600.0)
    hit = 1 - (1 - 6 / 128) ** 1024
    assert hit > 0.999999 and b.weight_bytes == pytest.approx(3e9 + 60e9 * hit)
    assert b.state_bytes == 2 * 1024 * 48e6 and b.kv_bytes == 1024 * 1024 * 6e3
    assert b.flops == pytest.approx(2 * (3e9 + 60e9 * 6 / 128) / 2 * 1024)
    assert b.memory_ms == pytest.approx((b.weight_bytes + b.state_bytes + b.kv_bytes) / 4e12 * 1e3)
    assert b.compute_ms == pytest.approx(b.flops / 600e12 * 1e3)
    assert b.sum_ms == pytest.approx(b.memory_ms + b.compute_ms) and b.max_ms == b.memory_ms
    lines = step_split.split_lines(step_split.StepSplit(2, 60.0, 50.0, {"ssu": 25.0}, 700.0), b)
    assert "host gaps 10.00" in lines[0] and "ssu 25.00" in lines[0] and f"sum {b.sum_ms:.2f} ms" in lines[1]
