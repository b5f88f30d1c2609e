"""Smoke test of benchmarks/fp8_decode_sweep.py: `--tiny` runs every case (the FP8 GEMV, the grouped GEMVs' up and
down passes, the whole MoE op) on the Triton CPU interpreter at shrunken sizes and writes its rows and each case's
best as JSON; every variant matches its torch reference."""

from __future__ import annotations

import json
import math

from tests.kernels.triton_test_util import run_interpreted


def test_fp8_decode_sweep_tiny(tmp_path):
    out = tmp_path / "sweep.json"
    run_interpreted(["benchmarks/fp8_decode_sweep.py", "--tiny", "--layers", "1", "--reps", "1", "--out", str(out)])
    result = json.loads(out.read_text(encoding="utf-8"))
    rows, best = result["rows"], result["best"]
    cases = ["gemv 40x64", "fp8 experts up pass", "fp8 experts down pass", "fp8 moe T=1"]
    assert list(best) == cases
    for r in rows:
        assert math.isfinite(r["us"]) and float(r["rel_err"]) < 1e-4, r
    variants = {c: [r["variant"] for r in rows if r["case"] == c] for c in cases}
    assert len(variants["gemv 40x64"]) == 3 and any("split_k=2" in v for v in variants["gemv 40x64"])
    assert any("shared_chunks=2" in v for v in variants["fp8 experts down pass"])
    for c in cases:  # the default (first row) and the fastest were timed twice; the best is one of those
        assert "us_mean" in next(r for r in rows if r["case"] == c)
        assert best[c]["variant"] in variants[c] and "us_mean" in best[c]
