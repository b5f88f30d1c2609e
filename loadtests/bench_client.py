"""Async benchmark client for an OpenAI-compatible endpoint (hybrid-serve or any other).

    python -m loadtests.bench_client --base-url http://127.0.0.1:8000/v1 --workload shared_prefix \
        --groups 8 --per-group 8 --concurrency 16 --max-tokens 32

Every request streams (`stream_options.include_usage`), so the client measures time to first token,
inter-token latency (per content chunk) and end-to-end latency, and reads prompt / cached /
completion tokens from the final usage chunk. Output: one JSON summary (percentiles in seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import httpx

from loadtests.workloads import multi_turn_sessions, shared_prefix_workload


@dataclass(frozen=True)
class RequestResult:
    """Measurements of one streamed completion or chat completion."""

    ttft_s: float | None  # request start -> first event carrying a choice (a token, even one with no text yet)
    itl_s: tuple[float, ...]  # gaps between consecutive choice events (one event may hold several tokens)
    e2e_s: float  # request start -> [DONE]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str  # completion text, or chat content (reasoning excluded)
    error: str | None = None  # error message when the request failed
    num_chunks: int = 0  # choice events received
    finish_reason: str | None = None  # the last finish_reason seen
    # request start -> first event whose choice has text (content or reasoning): a token that ends inside a UTF-8
    # character, or a special token, streams with empty text; guidellm stamps its TTFT here
    ttft_text_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (completion_tokens - 1)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class Summary:
    """Aggregate of a benchmark run (latencies in seconds)."""

    num_requests: int
    num_errors: int
    duration_s: float
    output_tokens_per_s: float
    cache_hit_ratio: float  # sum(cached_tokens) / sum(prompt_tokens)
    ttft: dict[str, float] = field(default_factory=dict)
    ttft_text: dict[str, float] = field(default_factory=dict)  # to the first event with text (RequestResult)
    itl: dict[str, float] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0
    tokens_per_chunk: float = 0.0  # completion tokens / choice events (1.0: one event per token)
    first_error: str | None = None


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": statistics.fmean(values), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def _has_text(choice: dict[str, Any]) -> bool:
    """Whether a stream choice carries any text: completion text, chat content or reasoning."""
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))


def _choice_text(choice: dict[str, Any]) -> str:
    """Completion text, or chat content; reasoning counts as output for timing but not as text."""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def sse_lines(resp: httpx.Response):
    """The response's lines split at CR/LF only, as Server-Sent Events define them (httpx's `aiter_lines` also
    splits at U+2028, U+0085 and other Unicode line breaks, which JSON strings in an event may hold unescaped)."""
    async for line in _split_lines(resp.aiter_bytes()):
        yield line


async def _split_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Lines of a byte stream split at CR, LF and CRLF only (see `sse_lines`)."""
    buf = b""
    async for data in chunks:
        buf += data
        *lines, buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode()
    if buf:
        yield buf.decode()


class _StreamMeasure:
    """What one streamed request has received so far, fed line by line; `result()` makes its RequestResult."""

    def __init__(self) -> None:
        self.start = time.perf_counter()  # request start (before it is sent)
        self.ttft: float | None = None
        self.ttft_text: float | None = None
        self.last = self.start  # time of the previous choice event
        self.gaps: list[float] = []
        self.text: list[str] = []
        self.usage: dict[str, Any] = {}
        self.chunks = 0
        self.finish: str | None = None

    def line(self, line: str) -> str | None:
        """Takes one SSE line; returns the error message if it is an error event (the stream is over then)."""
        if not line.startswith("data: ") or line == "data: [DONE]":
            return None
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            return event["error"].get("message", "error")
        self.usage = event.get("usage") or self.usage
        choices = event.get("choices") or []
        if choices:
            now = time.perf_counter()
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.gaps.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1
        for choice in choices:
            self.text.append(_choice_text(choice))
            self.finish = choice.get("finish_reason") or self.finish
            if self.ttft_text is None and _has_text(choice):
                self.ttft_text = now - self.start
        return None

    def result(self, error: str | None = None) -> RequestResult:
        """The measurements; with `error`, token counts are 0 (a failed request delivered no usable output)."""
        e2e = time.perf_counter() - self.start
        if error is not None:
            return RequestResult(
                self.ttft, tuple(self.gaps), e2e, 0, 0, 0, "".join(self.text), error, self.chunks, self.finish,
                self.ttft_text,
            )  # fmt: skip
        details = self.usage.get("prompt_tokens_details") or {}
        return RequestResult(
            self.ttft,
            tuple(self.gaps),
            e2e,
            self.usage.get("prompt_tokens", 0),
            details.get("cached_tokens", 0),
            self.usage.get("completion_tokens", 0),
            "".join(self.text),
            None,
            self.chunks,
            self.finish,
            self.ttft_text,
        )


def _streamed(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> RequestResult:
    """One streamed `/completions` or `/chat/completions` request (`stream` and `include_usage` are set here),
    measured: every SSE event with a choice counts as a chunk."""
    body = _streamed(body)
    m = _StreamMeasure()
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")
                return RequestResult(None, (), time.perf_counter() - m.start, 0, 0, 0, "",
                                     f"HTTP {resp.status_code}: {detail}")  # fmt: skip
            async for line in sse_lines(resp):
                if (error := m.line(line)) is not None:
                    return m.result(error)
    except httpx.HTTPError as exc:
        return m.result(f"{type(exc).__name__}: {exc}")
    return m.result()


async def stream_request_aiohttp(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> RequestResult:
    """`stream_request` over aiohttp (`url` absolute): the same request and measurements. aiohttp's client costs
    the sending process a fraction of httpx's CPU per streamed request, so a load generator built on it stays
    off the path it measures."""
    body = _streamed(body)
    m = _StreamMeasure()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                detail = (await resp.read()).decode(errors="replace")
                return RequestResult(None, (), time.perf_counter() - m.start, 0, 0, 0, "",
                                     f"HTTP {resp.status}: {detail}")  # fmt: skip
            async for line in _split_lines(resp.content.iter_any()):
                if (error := m.line(line)) is not None:
                    return m.result(error)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return m.result(f"{type(exc).__name__}: {exc}")
    return m.result()


async def stream_chat(
    client: httpx.AsyncClient,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """One streamed chat completion, measured."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, **(extra or {})}
    return await stream_request(client, "/chat/completions", body)


def summarize(results: list[RequestResult], duration_s: float) -> Summary:
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.completion_tokens for r in ok)
    chunks = sum(r.num_chunks for r in ok)
    return Summary(
        num_requests=len(results),
        num_errors=len(results) - len(ok),
        duration_s=duration_s,
        output_tokens_per_s=output / duration_s if duration_s > 0 else 0.0,
        cache_hit_ratio=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        ttft=_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        ttft_text=_percentiles([r.ttft_text_s for r in ok if r.ttft_text_s is not None]),
        itl=_percentiles([g for r in ok for g in r.itl_s]),
        e2e=_percentiles([r.e2e_s for r in ok]),
        tpot=_percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        output_tokens=output,
        tokens_per_chunk=output / chunks if chunks else 0.0,
        first_error=next((r.error for r in results if r.error is not None), None),
    )


async def bench_shared_prefix(
    client: httpx.AsyncClient,
    model: str,
    groups: int,
    per_group: int,
    concurrency: int,
    max_tokens: int,
    prefix_words: int = 200,
    seed: int = 0,
) -> Summary:
    """Chat requests sharing per-group system prompts, `concurrency` in flight."""
    workload = shared_prefix_workload(groups, per_group, 0, 0, (0, 1), prefix_words=prefix_words, seed=seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(messages: list[dict[str, str]]) -> RequestResult:
        async with gate:
            return await stream_chat(client, model, messages, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(one(r.messages) for r in workload))
    return summarize(list(results), time.perf_counter() - start)


async def bench_multi_turn(
    client: httpx.AsyncClient, model: str, sessions: int, turns: int, concurrency: int, max_tokens: int, seed: int = 0
) -> Summary:
    """Conversations that resend their growing history each turn; sessions run concurrently."""
    gate = asyncio.Semaphore(concurrency)

    async def converse(session: Any) -> list[RequestResult]:
        history = [{"role": "system", "content": session.system}]
        out = []
        for turn in session.user_turns:
            history.append({"role": "user", "content": turn})
            async with gate:
                result = await stream_chat(client, model, list(history), max_tokens)
            out.append(result)
            history.append({"role": "assistant", "content": result.text})
        return out

    start = time.perf_counter()
    per_session = await asyncio.gather(*(converse(s) for s in multi_turn_sessions(sessions, turns, seed=seed)))
    return summarize([r for rs in per_session for r in rs], time.perf_counter() - start)


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _main(ns: argparse.Namespace) -> Summary:
    async with httpx.AsyncClient(
        base_url=ns.base_url, timeout=ns.timeout_s, headers={"Authorization": f"Bearer {ns.api_key}"}
    ) as client:
        model = ns.model or await _first_model(client)
        if ns.workload == "shared_prefix":
            return await bench_shared_prefix(
                client, model, ns.groups, ns.per_group, ns.concurrency, ns.max_tokens, ns.prefix_words, ns.seed
            )
        return await bench_multi_turn(client, model, ns.sessions, ns.turns, ns.concurrency, ns.max_tokens, ns.seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--workload", choices=("shared_prefix", "multi_turn"), default="shared_prefix")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=200)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    summary = asyncio.run(_main(p.parse_args(argv)))
    print(json.dumps(asdict(summary), indent=2))
    return 1 if summary.num_errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
