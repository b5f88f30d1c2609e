"""Smoke tests of benchmarks/kernels.py's launch-shape sweeps (benchmarks/gemv_sweep.py): `--tiny` runs the gemv and
moe_tune groups on the Triton CPU interpreter at shrunken sizes, one or two variants each, and writes the row table
and the best-vs-default summary; the Nano shapes come from the repo's config; a spent --budget-s skips cases."""

from __future__ import annotations

import math

from tests.kernels.triton_test_util import run_interpreted


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_kernels_bench_tiny_sweeps(tmp_path):
    out = tmp_path / "tune.md"
    run_interpreted(["benchmarks/kernels.py", "--tiny", "--only", "gemv,moe_tune", "--out", str(out)])
    text = out.read_text(encoding="utf-8")
    rows = [_cells(line) for line in text.splitlines() if line.startswith(("| gemv ", "| moe"))]
    table = [r for r in rows if len(r) == 7]  # case | variant | µs | GB/s | % copy | vs default | rel err
    summary = [r for r in rows if len(r) == 13]
    for case, variant, us, *_, err in table:
        assert math.isfinite(float(us)) and float(err) < 1e-4, f"{case} / {variant}: {us} us, rel err {err}"
    variants = [r[1] for r in table]
    for kind in (
        "(default)",
        "cuBLAS F.linear",
        "split=2",
        "proxy expert-up kernel",
        "depth=3",
        "stages=2",
        "moe_experts_by_size",
        "tiled GEMMs",
        "moe_experts_gemv up",
    ):
        assert any(kind in v for v in variants), f"no {kind!r} row"
    cases = [r[0] for r in table]
    assert len({c for c in cases if c.startswith("gemv")}) == 2 and len({c for c in cases if c.startswith("moe")}) == 3
    assert sorted(r[0] for r in summary) == sorted(set(cases))
    assert all(r[3] != "-" and float(r[8].rstrip("x")) > 0 for r in summary)


def test_nano_sweep_shapes_from_config():
    from benchmarks import gemv_sweep

    s = gemv_sweep.nano_shapes()
    assert {(n, k) for _, n, k in s.gemv} == {
        (2688, 4096),
        (4096, 2688),
        (256, 2688),
        (4608, 2688),
        (10304, 2688),
        (131072, 2688),
    }
    assert (s.experts, s.top_k, s.hidden, s.inter, s.shared) == (128, 6, 2688, 1856, 3712)
    assert len(gemv_sweep.EXPERT_SWEEP) + 1 <= 40 and len(set(gemv_sweep.EXPERT_SWEEP)) == len(gemv_sweep.EXPERT_SWEEP)
    for name, n, k in s.gemv:  # <= 15 rows per shape; the default first, no duplicate launch shapes
        case = gemv_sweep.gemv_case(name, n, k, "cpu", tiny=False)
        names = [v.name for v in case.variants]
        assert len(names) <= 15 and len(set(names)) == len(names) and case.variants[0].kind == "default"


def test_sweep_past_budget_skips_everything():
    from benchmarks import gemv_sweep

    cases = gemv_sweep.moe_cases(gemv_sweep.TINY, "cpu", tiny=True)
    emitted: list[str] = []
    rows, summary = gemv_sweep.run(cases, 1.0, "cpu", True, deadline=-math.inf, emit=emitted.append)
    assert rows == emitted and all("skipped: past --budget-s" in r for r in rows)
    assert all(c.sets == [] for c in cases)  # nothing was built
    assert sum(line.startswith("| moe") for line in summary) == 3
