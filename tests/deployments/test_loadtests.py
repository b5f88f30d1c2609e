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


def test_aiohttp_and_httpx_clients_measure_the_same_stream():
    """The benchmark's two HTTP clients read one SSE stream (served by aiohttp's own server on 127.0.0.1, written
    in pieces that cut an event and a CRLF) into the same text, chunks, usage and finish reason; an error event and
    an HTTP error status come back as the request's error."""
    import asyncio

    import aiohttp
    import httpx
    from aiohttp import web

    from loadtests.bench_client import stream_request, stream_request_aiohttp

    events = [
        'data: {"choices": [{"index": 0, "text": "a\u2028b", "finish_reason": null}]}\r\n\r\n',
        'data: {"choices": [{"index": 0, "text": "", "finish_reason": null}]}\n\n',
        'data: {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}\r',
        '\rdata: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, '
        '"prompt_tokens_details": {"cached_tokens": 2}}}\n\ndata: [DONE]\n\n',
    ]
    wire = "".join(events).encode()
    pieces = [wire[:30], wire[30:75], wire[75:200], wire[200:]]
    seen_bodies = []

    async def sse(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen_bodies.append(body)
        if body["prompt"] == "refuse":
            return web.json_response({"error": {"message": "no"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for piece in pieces if body["prompt"] == "ok" else [b'data: {"error": {"message": "engine failed"}}\n\n']:
            await resp.write(piece)
            await asyncio.sleep(0.01)
        return resp

    async def run() -> list:
        app = web.Application()
        app.router.add_post("/v1/completions", sse)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        out = []
        try:
            async with aiohttp.ClientSession() as session, httpx.AsyncClient(base_url=base) as client:
                for prompt in ("ok", "fail", "refuse"):
                    body = {"prompt": prompt, "max_tokens": 3}
                    out.append(await stream_request_aiohttp(session, base + "/completions", body))
                    out.append(await stream_request(client, "/completions", body))
        finally:
            await runner.cleanup()
        return out

    a_ok, h_ok, a_fail, h_fail, a_refused, h_refused = asyncio.run(run())
    for r in (a_ok, h_ok):
        assert (r.text, r.num_chunks, r.finish_reason, r.error) == ("a\u2028bc", 3, "length", None)
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (5, 2, 3)
        assert 0 < r.ttft_s <= r.e2e_s and len(r.itl_s) == 2 and r.ttft_text_s == r.ttft_s
    assert a_fail.error == h_fail.error == "engine failed" and a_fail.completion_tokens == 0
    assert a_refused.error.startswith("HTTP 400") and h_refused.error.startswith("HTTP 400")
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in seen_bodies)
