"""Coalesced streaming: a streamed completion of N tokens arrives in at most N chunks holding exactly the N tokens
the non-streamed request returns (token by token, through logprobs), in order, with one finish reason and the
right usage, on both endpoints, with n = 1 and n = 2. The app sends few chunks per second
(`stream_chunks_per_s`), so chunks hold several tokens.

Grouped engine calls: a burst of concurrent streams of different lengths shares Serve calls (the replica's
requests per grouped call > 1), each stream gets exactly its own tokens, a prompt the engine refuses (longer than
the small KV pool, within the context length) gets its 400 error object, and a client that leaves mid-stream has
its request aborted in the engine while the others finish."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from ray import serve

from service.deployments.app import build_app
from service.deployments.pool_audit import PoolAudit
from tests.deployments.serve_testkit import replica_stats, wait_until

N = 40
KV_PAGES = 200  # x 16-token pages: a 3,300-token prompt fits the context length (4,096) but not the KV pool


@pytest.fixture(scope="module")
def coalescing(cluster, tiny_model_path):
    name = "coalesce"
    serve.run(
        build_app(
            {
                "model_path": tiny_model_path,
                "replicas": 1,
                "stream_chunks_per_s": 8.0,
                "num_kv_pages": KV_PAGES,
                "group_max_requests": 64,
                "canary": {"enabled": False},
                "route_prefix": f"/{name}",
            }
        ),
        name=name,
        route_prefix=f"/{name}",
    )
    with httpx.Client(base_url=f"http://127.0.0.1:{cluster.http_port}/{name}/v1", timeout=120) as c:
        yield c
    serve.delete(name)


def _events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    out = []
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(json.loads(line[len("data: ") :]))
            elif line.startswith("data: "):
                assert line == "data: [DONE]"
    return out


def _tokens(path: str, choice: dict) -> list[str]:
    lp = choice.get("logprobs") or {}
    return list(lp.get("tokens") or []) if path == "/completions" else [e["token"] for e in lp.get("content") or []]


def _text(path: str, choice: dict) -> str:
    if path == "/completions":
        return choice.get("text") or ""
    return choice.get("delta", {}).get("content") or choice.get("message", {}).get("content") or ""


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize("n", [1, 2])
def test_streamed_tokens_arrive_once_in_order_in_at_most_n_chunks(coalescing, path, n):
    body = {
        "model": "tiny",
        "max_tokens": N,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 11,
        "n": n,
        "logprobs": 0 if path == "/completions" else True,
    }
    body.update(
        {"prompt": "The robot counts the stones"}
        if path == "/completions"
        else {
            "messages": [{"role": "user", "content": "Count the stones."}],
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    full = coalescing.post(path, json=body).json()
    events = _events(coalescing, path, body)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == N * n
    assert events[-1]["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    by_choice: dict[int, list[dict]] = {}
    for e in events[:-1]:
        assert len(e["choices"]) == 1
        by_choice.setdefault(e["choices"][0]["index"], []).append(e["choices"][0])
    assert sorted(by_choice) == list(range(n))
    for choice in full["choices"]:
        chunks = by_choice[choice["index"]]
        assert 1 <= len(chunks) < N, f"{len(chunks)} chunks for {N} tokens: not coalesced"
        assert [c.get("finish_reason") for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        streamed = [t for c in chunks for t in _tokens(path, c)]
        assert len(streamed) == N and streamed == _tokens(path, choice)
        assert "".join(_text(path, c) for c in chunks) == _text(path, choice)


async def _stream(c: openai.AsyncOpenAI, prompt: list[int], max_tokens: int, n: int = 1) -> dict[int, dict]:
    """One streamed completion read to its end: per choice index its tokens, text and finish reasons, plus usage."""
    stream = await c.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, n=n, temperature=1.0, seed=7, logprobs=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    out: dict[int, dict] = {}
    async for chunk in stream:
        if chunk.usage is not None:
            out[-1] = {"completion_tokens": chunk.usage.completion_tokens}
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"tokens": [], "text": "", "finish": []})
            got["tokens"] += choice.logprobs.tokens if choice.logprobs else []
            got["text"] += choice.text
            got["finish"].append(choice.finish_reason)
    return out


async def _disconnect_after(c: openai.AsyncOpenAI, prompt: list[int], chunks: int) -> int:
    stream = await c.completions.create(
        model="tiny", prompt=prompt, max_tokens=2500, stream=True, extra_body={"ignore_eos": True}
    )
    read = 0
    async for _ in stream:
        read += 1
        if read == chunks:
            break
    await stream.close()  # the connection closes mid-stream
    return read


async def _refused(c: openai.AsyncOpenAI, prompt: list[int]) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model="tiny", prompt=prompt, max_tokens=4, stream=True)
    return info.value.body


def test_grouped_burst_keeps_every_stream_its_own(coalescing):
    base_url, name = str(coalescing.base_url), "coalesce"
    lengths = [3, 9, 17, 26, 5, 12]
    prompts = [[300 + 7 * i + k for k in range(5 + i)] for i in range(len(lengths) + 1)]  # distinct prompts
    before = next(iter(replica_stats(name, 1).values()))

    async def burst() -> list:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=120, max_retries=0) as c:
            return await asyncio.gather(
                *(_stream(c, p, n) for p, n in zip(prompts, lengths)),
                _stream(c, prompts[-1], 8, n=3),
                _refused(c, [11] * 3300),
                _disconnect_after(c, [900, 901, 902], 2),
            )

    *streams, refused, read = asyncio.run(asyncio.wait_for(burst(), timeout=120))
    assert read == 2
    assert refused["param"] == "prompt" and "KV pool" in refused["message"], refused
    after = next(iter(replica_stats(name, 1).values()))
    calls, requests = after["group_calls"] - before["group_calls"], after["group_requests"] - before["group_requests"]
    assert calls >= 1 and requests / calls > 1, (calls, requests)
    held: list[str] = []  # what the engine held at the last look

    def nothing_held() -> bool:
        held[:] = PoolAudit(**next(iter(replica_stats(name, 1, audit=True).values()))["pool_audit"]).leaks()
        return not held

    try:  # a lost abort leaves the request running its 2,500 tokens: holding pages past 20 s, or counted below
        wait_until(nothing_held, timeout_s=20, what="no request holding engine pages or slots")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; held: {held}") from None
    final = next(iter(replica_stats(name, 1).values()))
    aborted = final["generation_tokens"] - before["generation_tokens"] - sum(lengths) - 3 * 8
    assert 2 <= aborted < 2500, f"the disconnected request generated {aborted} tokens: not aborted"

    with httpx.Client(base_url=base_url, timeout=120) as http:  # references: the same requests, not streamed
        for (p, n), got in zip([*zip(prompts, lengths), (prompts[-1], 8)], streams):
            ref = http.post("/completions", json={"model": "tiny", "prompt": p, "max_tokens": n, "n": len(got) - 1,
                            "temperature": 1.0, "seed": 7, "logprobs": 0, "ignore_eos": True}).json()  # fmt: skip
            assert got[-1]["completion_tokens"] == n * (len(got) - 1)
            for choice in ref["choices"]:
                mine = got[choice["index"]]
                assert mine["tokens"] == choice["logprobs"]["tokens"] and len(mine["tokens"]) == n
                assert mine["text"] == choice["text"]
                assert mine["finish"][-1] == "length" and set(mine["finish"][:-1]) <= {None}
