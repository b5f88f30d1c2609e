"""serving_bench's report (benchmarks/serving_report.py): the table's ratio column is
each served run against its case's in-process run, repeats and warnings are listed, the engine core's line is per
step, and the TTFT split compares the client's mean with the engine replica's. Summaries come from the load-test
client's own `summarize`; no server runs here."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from benchmarks.serving_cases import Case, Workload
from benchmarks.serving_report import core_line, report, round_ratios, ttft_split
from loadtests.bench_client import RequestResult, summarize

CORE = "ray_hybrid_serve_engine_core_"


def _summary(num_requests: int, tokens: int, ttft_s: float, duration_s: float):
    results = [RequestResult(ttft_s, (0.01,) * (tokens - 1), ttft_s + 0.5, 8, 0, tokens, "x", num_chunks=tokens)]
    return summarize(results * num_requests, duration_s)


def _run(summary, cpu_s: float) -> dict:
    return {"summary": asdict(summary), "cpu_s": {"ingress": cpu_s}}


def test_workload_parse_and_label():
    w = Workload.parse("128:256:512:64")
    assert (w.isl, w.osl, w.num_prompts, w.concurrency) == (128, 256, 512, 64)
    assert w.label == "128in/256out x512 c64"
    for bad in ("128:256:512", "128:0:512:64", "a:1:1:1"):
        with pytest.raises(ValueError, match="ISL:OSL:PROMPTS:CONCURRENCY"):
            Workload.parse(bad)


def test_report_rows_ratios_and_warnings():
    case = Case(Workload.parse("8:4:10:2"), "completions", [], [])
    key = "completions 8in/4out x10 c2"
    inproc = {key: _run(_summary(10, 4, 0.05, 1.0), 0.0)}  # 40 tokens in 1 s
    served = {
        key: _run(_summary(10, 4, 0.08, 2.0), 0.04),  # 20 tok/s: 0.50x; 0.04 s / 40 tokens = 1.00 ms per token
        key + " (repeat 2)": _run(_summary(10, 4, 0.08, 1.25), 0.0),  # 32 tok/s: 0.80x
        "_warnings": {"queue_length_warnings": 3, "serve_log_dir": "/logs", "gpu_processes": "not a CUDA run"},
    }
    lines = report(served, inproc, [case])
    rows = [line.split("|")[1:-1] for line in lines if line.startswith(f"| {key}")]
    assert [(r[1].strip(), r[2].strip(), r[3].strip()) for r in rows] == [
        ("in-process", "40", "1.00x"),
        ("served", "20", "0.50x"),
        ("served", "32", "0.80x"),
    ]
    assert rows[1][4].strip().startswith("80.0 / ") and rows[1][9].strip() == "ingress 1.00"
    assert "queue-length warnings in the serve logs: 3 (/logs)" in "\n".join(lines)


def test_core_line_and_ttft_split_are_per_step_and_per_request():
    core = {
        CORE + "steps_total": 100.0,
        "ray_hybrid_serve_generation_tokens_total": 3000.0,
        CORE + "seconds_total{host}": 0.9,
        CORE + "seconds_total{device_wait}": 0.1,
        CORE + "seconds_total{send}": 0.05,
        CORE + "seconds_total{gc}": 0.0,
        "ray_hybrid_serve_time_to_first_token_seconds_sum": 6.0,
        "ray_hybrid_serve_time_to_first_token_seconds_count": 100.0,
    }
    line = core_line(core, duration_s=2.0)
    assert "100 steps, 30.0 outputs/step, 10.00 ms/step in Engine.step (0.50 of the run" in line
    assert "host 9.00, device wait 1.00" in line and "sender 0.500 ms/step" in line
    split = ttft_split(_summary(4, 4, 0.08, 1.0), core)
    assert split == "TTFT mean 80.0 ms at the client, 60.0 ms in the engine replica"
    assert ttft_split(_summary(4, 4, 0.08, 1.0), {}) == "TTFT split: no counters"
    assert core_line({}, 1.0) == "engine core: no counters"


def test_round_ratios_pair_each_round_and_take_the_median():
    case = Case(Workload.parse("8:4:10:2"), "completions", [], [])
    key = "completions 8in/4out x10 c2"

    def round_of(served_s: float, inproc_s: float) -> tuple[dict, dict]:  # 40 tokens in that many seconds
        served = {key: _run(_summary(10, 4, 0.1, served_s), 0.0), key + " (repeat 2)": _run(_summary(10, 4, 0.1, 9), 0)}
        return served, {key: _run(_summary(10, 4, 0.1, inproc_s), 0.0)}

    rounds = [round_of(2.0, 1.0), round_of(1.0, 1.0), round_of(1.25, 1.0)]  # 0.50x, 1.00x, 0.80x
    assert round_ratios(rounds, [case]) == [f"{key}: served / in-process by round 0.50x, 1.00x, 0.80x; median 0.80x"]
    assert round_ratios([({}, {})], [case]) == []
