"""The async benchmark client against the live endpoint: shared-prefix and multi-turn workloads run,
measure latencies and see the prefix cache through `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import json

import pytest

from loadtests import bench_client
from loadtests.workloads import multi_turn_sessions, shared_prefix_workload


def test_workloads_share_prefixes_per_group():
    wl = shared_prefix_workload(3, 2, 32, 4, token_id_range=(10, 50), order="grouped", seed=3)
    assert [(r.group, r.index_in_group) for r in wl] == [(g, i) for g in range(3) for i in range(2)]
    assert wl[0].prompt_token_ids[:32] == wl[1].prompt_token_ids[:32] != wl[2].prompt_token_ids[:32]
    assert wl[0].messages[0] == wl[1].messages[0] and wl[0].messages[1] != wl[1].messages[1]
    assert all(10 <= t < 50 for r in wl for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="order"):
        shared_prefix_workload(1, 1, 1, 1, (0, 2), order="random")
    sessions = multi_turn_sessions(2, 3)
    assert len(sessions) == 2 and all(len(s.user_turns) == 3 for s in sessions)


@pytest.mark.parametrize("workload", ["shared_prefix", "multi_turn"])
def test_bench_client_runs_against_the_server(main_app, capsys, workload):
    rc = bench_client.main(
        [
            "--base-url",
            main_app.base_url,
            "--workload",
            workload,
            "--groups",
            "2",
            "--per-group",
            "3",
            "--prefix-words",
            "120",
            "--sessions",
            "2",
            "--turns",
            "3",
            "--concurrency",
            "4",
            "--max-tokens",
            "4",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["num_errors"] == 0 and summary["num_requests"] == 6
    assert summary["ttft"]["p50"] > 0 and summary["e2e"]["p99"] >= summary["e2e"]["p50"]
    assert summary["cache_hit_ratio"] > 0, summary


def test_sse_lines_split_only_at_cr_lf():
    """A JSON string holding U+2028 / U+0085 stays inside its event line; CRLF, CR and a line cut across chunks
    are handled."""
    import asyncio

    import httpx

    from loadtests.bench_client import sse_lines

    chunks = ['data: {"t": "a\u2028b\u0085c"}\r\n', "\r\ndata: [DO", "NE]\rlast"]

    def handler(request):
        return httpx.Response(200, stream=httpx.ByteStream(b"".join(c.encode() for c in chunks)))

    async def read():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            async with client.stream("GET", "http://127.0.0.1/x") as resp:
                return [line async for line in sse_lines(resp)]

    assert asyncio.run(read()) == ['data: {"t": "a\u2028b\u0085c"}', "", "data: [DONE]", "last"]
