"""Coalesced streaming: a streamed completion of N tokens arrives in at most N chunks holding exactly the N tokens
the non-streamed request returns (token by token, through logprobs), in order, with one finish reason and the
right usage, on both endpoints, with n = 1 and n = 2. The app sends few chunks per second
(`stream_chunks_per_s`), so chunks hold several tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from ray import serve

from service.deployments.app import build_app

N = 40


@pytest.fixture(scope="module")
def coalescing(cluster, tiny_model_path):
    name = "coalesce"
    serve.run(
        build_app(
            {
                "model_path": tiny_model_path,
                "replicas": 1,
                "stream_chunks_per_s": 8.0,
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
