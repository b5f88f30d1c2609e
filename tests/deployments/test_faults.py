"""Faults: bad input gets OpenAI 400/404 bodies and never hurts a replica; a client that leaves mid-stream
aborts its request (nothing left held outside the prefix cache); 64 concurrent streams all complete."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from service.deployments.pool_audit import PoolAudit
from tests.deployments.serve_testkit import replica_stats, wait_until


def _error_body(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "path,body,param,code",
    [
        ("/chat/completions", {**CHAT, "temperature": -1}, "temperature", None),
        ("/chat/completions", {**CHAT, "n": 0}, "n", None),
        ("/chat/completions", {**CHAT, "messages": []}, "messages", None),
        ("/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs", None),
        ("/chat/completions", {**CHAT, "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
        ("/completions", {"model": "tiny", "prompt": [5] * 5000}, "prompt", "context_length_exceeded"),
        ("/completions", {"model": "tiny", "prompt": [10**7]}, "prompt", None),
        ("/completions", {"model": "tiny", "prompt": "x", "echo": True}, "echo", None),
    ],
)
def test_invalid_parameters_get_400_with_openai_error(http, path, body, param, code):
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = _error_body(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code


def test_malformed_json_unknown_model_and_client_exceptions(http, client):
    resp = http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and _error_body(resp)["type"] == "invalid_request_error"
    resp = http.post("/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert resp.status_code == 404 and _error_body(resp)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=0)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    # the replicas are unharmed
    assert client.completions.create(model="tiny", prompt="still alive", max_tokens=2).choices[0].text is not None


def test_oversized_body_gets_413(http):
    resp = http.post("/completions", json={"model": "tiny", "prompt": "x" * (9 * 1024 * 1024)})
    assert resp.status_code == 413 and _error_body(resp)["code"] == "request_too_large"


def _held_by_requests(app_name: str) -> dict[str, list[str]]:
    """Per engine replica: what requests still hold (PoolAudit.leaks; empty once every request has left). Pages
    the prefix cache keeps are not counted: the aborted request's prompt may be cached on either replica."""
    stats = replica_stats(app_name, 2, audit=True)
    return {rid: PoolAudit(**s["pool_audit"]).leaks() for rid, s in stats.items()}


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(http, main_app):
    prompt = list(range(300, 300 + 101))  # off the snapshot grid
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    assert http.post("/completions", json={**body, "max_tokens": 1, "stream": False}).status_code == 200
    assert not any(_held_by_requests(main_app.name).values())
    generated_before = sum(s["generation_tokens"] for s in replica_stats(main_app.name, 2).values())
    events = 0
    with http.stream("POST", "/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:])
                events += 1
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    assert events == 3
    wait_until(
        lambda: not any(_held_by_requests(main_app.name).values()),
        timeout_s=20,
        what="no request holding engine pages or slots on any replica",
    )
    generated = sum(s["generation_tokens"] for s in replica_stats(main_app.name, 2).values()) - generated_before
    assert 3 <= generated < 3000, "the request was not aborted in the engine"


def test_64_concurrent_streams_complete(main_app):
    async def run() -> list[tuple[str | None, int]]:
        async with openai.AsyncOpenAI(base_url=main_app.base_url, api_key="none", timeout=120, max_retries=0) as c:

            async def one(i: int) -> tuple[str | None, int]:
                stream = await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": f"Request {i}: count the stones."}],
                    max_tokens=16,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                finish, completion_tokens = None, 0
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage:
                        completion_tokens = chunk.usage.completion_tokens
                return finish, completion_tokens

            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(asyncio.wait_for(run(), timeout=180))
    assert len(results) == 64
    assert all(finish in ("stop", "length") and 1 <= n <= 16 for finish, n in results), results
