"""benchmarks/closed_loop_model.py: the simulated closed loop against schedules worked out by hand."""

from __future__ import annotations

import pytest

from benchmarks.closed_loop_model import LoopCosts, parse_decode_ms, simulate


def test_decode_step_time_is_linear_between_measured_batches():
    c = LoopCosts(parse_decode_ms("256:20,1:2,512:30"), 1e6, 0.0)
    assert c.decode_ms == ((1, 2.0), (256, 20.0), (512, 30.0))
    assert c.decode_step_ms(0) == 0.0
    assert c.decode_step_ms(384) == pytest.approx(25.0)
    assert c.decode_step_ms(1024) == pytest.approx(60.0)  # proportional past the last measured batch


def test_one_wave_by_hand():
    """4 prompts of 8 tokens, 3 outputs, budget 20, decode 10 ms at any batch, prefill 1 token/ms, gap 5 ms.
    Step 1: prefills 8 + 8 + 4 (20 ms; A and B sample). Step 2: A, B decode, C's last 4 + D's 8 (10 + 12 + 5 ms; C
    and D sample). Step 3: A, B end; C, D decode (10 ms). Step 4: C, D end (10 ms). 12 tokens in 67 ms."""
    c = LoopCosts(((1, 10.0), (4, 10.0)), 1000.0, 5.0)
    r = simulate(c, num_prompts=4, isl=8, osl=3, concurrency=4, token_budget=20)
    assert (r.steps, r.mixed_steps) == (4, 1)
    assert r.seconds == pytest.approx(0.067)
    assert (r.decode_seconds, r.prefill_seconds, r.gap_seconds) == pytest.approx((0.030, 0.032, 0.005))
    assert r.output_tps == pytest.approx(12 / 0.067)


def test_closed_loop_admits_as_requests_finish():
    """Concurrency 1, 3 prompts, free prefill: each request is 1 prefill step (no decode time) + 2 decode steps of
    10 ms, one after the other."""
    c = LoopCosts(((1, 10.0),), 1e12, 0.0)
    r = simulate(c, num_prompts=3, isl=5, osl=3, concurrency=1, token_budget=100)
    assert r.steps == 9 and r.mixed_steps == 0
    assert r.seconds == pytest.approx(0.060, rel=1e-6)
