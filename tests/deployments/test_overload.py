"""Overload: beyond the engine deployment's queue bound, requests get 503 with an OpenAI error body,
the admitted ones complete, and the replica keeps serving afterwards."""

from __future__ import annotations

import asyncio

import httpx


async def _burst(base_url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as c:
        body = {"model": "tiny", "prompt": "overload", "max_tokens": 40, "ignore_eos": True}
        return await asyncio.gather(*[c.post("/completions", json=body) for _ in range(n)])


def test_overload_gets_503_and_loses_nothing(small_app):
    responses = asyncio.run(_burst(small_app.base_url, 16))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) > 0, "16 concurrent requests against 1 ongoing + 4 queued should overflow"
    assert codes.count(200) >= 5, codes
    for r in responses:
        if r.status_code == 503:
            err = r.json()["error"]
            assert err["code"] == "overloaded" and "overloaded" in err["message"]
        else:
            assert r.json()["usage"]["completion_tokens"] == 40
    after = httpx.post(
        small_app.base_url + "/completions", json={"model": "tiny", "prompt": "again", "max_tokens": 3}, timeout=60
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
