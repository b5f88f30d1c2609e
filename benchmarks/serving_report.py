"""The report of `serving_bench`: the markdown table of both paths (with the guidellm cross-check's rows), the
engine core's per-step line and the TTFT split of a served run, and the ratios of alternating rounds."""

from __future__ import annotations

import statistics

from benchmarks.serving_cases import Case, case_key
from loadtests.bench_client import Summary


def core_line(core: dict[str, float], duration_s: float) -> str:
    """Where the engine core's wall time went over a timed run, per step: host work in Engine.step, waiting for the
    device in it, its sender thread; and outputs per step."""
    steps = core.get("ray_hybrid_serve_engine_core_steps_total", 0.0)
    if steps <= 0:
        return "engine core: no counters"
    tokens = core.get("ray_hybrid_serve_generation_tokens_total", 0.0)
    ph = {
        p: core.get(f"ray_hybrid_serve_engine_core_seconds_total{{{p}}}", 0.0)
        for p in ("host", "device_wait", "send", "gc")
    }
    in_step = ph["host"] + ph["device_wait"]
    return (
        f"engine core: {steps:.0f} steps, {tokens / steps:.1f} outputs/step, "
        f"{1e3 * in_step / steps:.2f} ms/step in Engine.step ({in_step / duration_s:.2f} of the run; host "
        f"{1e3 * ph['host'] / steps:.2f}, device wait {1e3 * ph['device_wait'] / steps:.2f}), "
        f"sender {1e3 * ph['send'] / steps:.3f} ms/step, garbage collector {1e3 * ph['gc'] / steps:.3f} ms/step"
    )


def ttft_split(summary: Summary, core: dict[str, float]) -> str:
    """The client's mean TTFT against the engine replica's (from its call to its first chunk): the difference is
    the path in front of the engine replica (HTTP, ingress, grouping, the Serve call)."""
    n = core.get("ray_hybrid_serve_time_to_first_token_seconds_count", 0.0)
    if not n or "mean" not in summary.ttft:
        return "TTFT split: no counters"
    replica_ms = 1e3 * core.get("ray_hybrid_serve_time_to_first_token_seconds_sum", 0.0) / n
    return f"TTFT mean {1e3 * summary.ttft['mean']:.1f} ms at the client, {replica_ms:.1f} ms in the engine replica"


def _median_of(runs: list[dict], client: str, key: str) -> float:
    return statistics.median(r[key] for r in runs if r["client"] == client)


def _ms(d: dict, key: str) -> str:
    return f"{1e3 * d[key]:.1f}" if key in d else "-"


def report(served: dict, inproc: dict, cases: list[Case]) -> list[str]:
    """The markdown table: per case the in-process run, then each served run with its ratio to the in-process
    output tok/s (and the guidellm rows under it); then the served runs' warnings."""
    lines = [
        "| workload | path | output tok/s | ratio | TTFT p50 / p90 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms "
        "| tokens/chunk | errors | host CPU ms per output token |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---|",
    ]
    for case in cases:
        key = case_key(case)
        base = inproc.get(key, {}).get("summary", {}).get("output_tokens_per_s")
        runs = [("in-process", key, inproc.get(key))]
        runs += [("served", k, r) for k, r in served.items() if k == key or k.startswith(key + " (repeat")]
        for path, label, res in runs:
            if res is not None:
                lines += _run_rows(path, label, res, base)
    warn = served.get("_warnings")
    if warn is not None:
        lines.append(
            f"\nqueue-length warnings in the serve logs: {warn['queue_length_warnings']} ({warn['serve_log_dir']})"
        )
        lines.append(f"server processes holding a CUDA context, by role: {warn.get('gpu_processes')}")
    return lines


def round_ratios(rounds: list[tuple[dict, dict]], cases: list[Case]) -> list[str]:
    """Per case: each round's served / in-process output tok/s (the round's first served run) and their median."""
    lines = []
    for case in cases:
        key = case_key(case)
        ratios = [
            served[key]["summary"]["output_tokens_per_s"] / inproc[key]["summary"]["output_tokens_per_s"]
            for served, inproc in rounds
            if key in served and key in inproc
        ]
        if ratios:
            each = ", ".join(f"{r:.2f}x" for r in ratios)
            lines.append(f"{key}: served / in-process by round {each}; median {statistics.median(ratios):.2f}x")
    return lines


def _run_rows(path: str, label: str, res: dict, base: float | None) -> list[str]:
    """One run's row (`base`: the in-process output tok/s of its case, if any), its guidellm row and first error."""
    s = res["summary"]
    ratio = f"{s['output_tokens_per_s'] / base:.2f}x" if base else "-"
    cpu = ", ".join(
        f"{role} {1e3 * sec / max(s['output_tokens'], 1):.2f}" for role, sec in res["cpu_s"].items() if sec > 0.005
    )
    t, tp, itl = s["ttft"], s["tpot"], s["itl"]
    lines = [
        f"| {label} | {path} | {s['output_tokens_per_s']:.0f} | {ratio} | {_ms(t, 'p50')} / "
        f"{_ms(t, 'p90')} / {_ms(t, 'p99')} | {_ms(tp, 'p50')} | {_ms(itl, 'p50')} / {_ms(itl, 'p99')} "
        f"| {s['tokens_per_chunk']:.2f} | {s['num_errors']} | {cpu} |"
    ]
    gl, rounds = res.get("guidellm"), res.get("rounds", [])
    if len(rounds) > 2 and "error" not in gl:  # alternating rounds on the same text prompts
        lines.append(_rounds_row(rounds))
    elif gl:
        lines.append(_guidellm_row(gl, s))
    if s.get("first_error"):
        lines.append(f"|  | first error: {s['first_error'][:200]} |")
    return lines


def _guidellm_row(gl: dict, s: dict) -> str:
    """guidellm's numbers against ours. Its TTFT ends at the first event with text, as our `ttft_text` does (our
    `ttft` ends at the first event with a token, which may have no text yet): TTFT is compared on that definition."""
    if "error" in gl:
        return f"|  | guidellm failed: {gl['error'][:300]} |"
    ours = s.get("ttft_text", {}).get("p50") or s["ttft"]["p50"]
    return (
        f"|  | guidellm | {gl['output_tokens_per_s']:.0f} "
        f"({100 * (gl['output_tokens_per_s'] / s['output_tokens_per_s'] - 1):+.1f} %) | | "
        f"p50 {1e3 * gl['ttft_p50_s']:.1f} ({100 * (gl['ttft_p50_s'] / ours - 1):+.1f} % against our p50 to the "
        f"first text, {1e3 * ours:.1f}; to the first token {1e3 * s['ttft']['p50']:.1f}) | | | "
        f"| {gl['errored']} | guidellm client {1e3 * gl['client_cpu_s'] / max(s['output_tokens'], 1):.2f} |"
    )


def _rounds_row(runs: list[dict]) -> str:
    """Medians over the alternating rounds (guidellm against ours), then every run in order."""
    tps = [_median_of(runs, c, "output_tokens_per_s") for c in ("guidellm", "ours")]
    ttft = [_median_of(runs, c, "ttft_p50_s") for c in ("guidellm", "ours")]
    each = "; ".join(f"{r['client']} {r['output_tokens_per_s']:.0f} tok/s {1e3 * r['ttft_p50_s']:.1f} ms" for r in runs)
    return (
        f"|  | medians of {len(runs) // 2} rounds, guidellm vs ours | {tps[0]:.0f} vs {tps[1]:.0f} "
        f"({100 * (tps[0] / tps[1] - 1):+.1f} %) | | p50 {1e3 * ttft[0]:.1f} vs {1e3 * ttft[1]:.1f} "
        f"({100 * (ttft[0] / ttft[1] - 1):+.1f} %) | | | | | runs: {each} |"
    )
