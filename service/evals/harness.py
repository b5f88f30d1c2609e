"""Score a chat endpoint (or an in-process engine) on the synthetic tasks.

A `Backend` answers conversations: `OpenAIBackend` over the OpenAI API with the `openai` client (any
endpoint), `EngineBackend` in process on our `Engine` (the reply parsed by the same reasoning and tool-call
parsers the server uses). `score` turns K sampled replies per question into pass@1 (mean fraction correct),
pass@k (any of the K correct), majority@k (the most frequent extracted answer is correct; ties go to the answer
seen first), no-answer (samples with no extractable answer) and truncated (samples stopped by max_tokens) counts,
and the prefix-cache hit ratio (cached prompt tokens / prompt tokens, from the API's usage).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from service.evals.tasks import Example, extract_answer


@dataclass(frozen=True)
class Reply:
    content: str | None  # visible answer (reasoning split off), None if empty
    tool_calls: tuple[dict[str, Any], ...]  # {"name": str, "arguments": dict}
    finish_reason: str  # "stop" | "length" | "tool_calls" ...
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Sampling:
    samples: int = 1  # K replies per question
    temperature: float = 0.0  # 0: greedy
    max_tokens: int = 64
    seed: int | None = None


class Backend(Protocol):
    async def answer(self, examples: Sequence[Example], sampling: Sampling) -> list[list[Reply]]:
        """K replies (in order) for each example's conversation."""


@dataclass(frozen=True)
class TaskScore:
    task: str
    num: int  # questions
    samples: int  # K replies per question
    pass_at_1: float  # mean over questions of (correct replies / K)
    pass_at_k: float  # fraction of questions with at least one correct reply
    majority_at_k: float  # fraction of questions whose most frequent answer is correct
    no_answer: int  # replies with no extractable answer
    truncated: int  # replies stopped by max_tokens
    hit_ratio: float  # cached prompt tokens / prompt tokens over all requests

    def row(self) -> str:
        return (
            f"{self.task:<10} n={self.num:<4} k={self.samples:<2} pass@1={self.pass_at_1:.3f} "
            f"pass@k={self.pass_at_k:.3f} maj@k={self.majority_at_k:.3f} no_answer={self.no_answer} "
            f"truncated={self.truncated} hit_ratio={self.hit_ratio:.3f}"
        )


def _majority(answers: list[str | None]) -> str | None:
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def score(task: str, examples: Sequence[Example], replies: Sequence[Sequence[Reply]]) -> TaskScore:
    if len(examples) != len(replies) or not examples:
        raise ValueError("score needs one list of replies per example, and at least one example")
    k = len(replies[0])
    p1 = pk = maj = 0.0
    no_answer = truncated = prompt = cached = 0
    for ex, reps in zip(examples, replies):
        answers = [extract_answer(task, r.content, list(r.tool_calls)) for r in reps]
        correct = [a == ex.answer for a in answers]
        p1 += sum(correct) / len(reps)
        pk += any(correct)
        maj += _majority(answers) == ex.answer
        no_answer += sum(a is None for a in answers)
        truncated += sum(r.finish_reason == "length" for r in reps)
        prompt += sum(r.prompt_tokens for r in reps)
        cached += sum(r.cached_tokens for r in reps)
    n = len(examples)
    return TaskScore(task, n, k, p1 / n, pk / n, maj / n, no_answer, truncated, cached / max(1, prompt))


class OpenAIBackend:
    """Chat completions over HTTP; `n=K` replies per request, at most `concurrency` requests in flight."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str = "none",
        concurrency: int = 16,
        timeout_s: float = 600.0,
    ) -> None:
        from openai import AsyncOpenAI

        self.client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self.model = model
        self.concurrency = concurrency

    async def _model(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model

    async def _one(self, ex: Example, sampling: Sampling, limit: asyncio.Semaphore) -> list[Reply]:
        async with limit:
            kw: dict[str, Any] = {"tools": list(ex.tools)} if ex.tools else {}
            if sampling.seed is not None:
                kw["seed"] = sampling.seed
            resp = await self.client.chat.completions.create(
                model=await self._model(),
                messages=list(ex.messages),
                n=sampling.samples,
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                **kw,
            )
        details = resp.usage.prompt_tokens_details if resp.usage else None
        cached = (details.cached_tokens or 0) if details else 0
        prompt = resp.usage.prompt_tokens if resp.usage else 0
        return [
            Reply(
                c.message.content,
                tuple(
                    {"name": t.function.name, "arguments": json.loads(t.function.arguments or "{}")}
                    for t in c.message.tool_calls or []
                ),
                c.finish_reason,
                prompt,
                cached,
            )
            for c in sorted(resp.choices, key=lambda c: c.index)
        ]

    async def answer(self, examples: Sequence[Example], sampling: Sampling) -> list[list[Reply]]:
        limit = asyncio.Semaphore(self.concurrency)
        return list(await asyncio.gather(*(self._one(ex, sampling, limit) for ex in examples)))


class EngineBackend:
    """In process on an `Engine`: every request of a call is added at once, so they share packed batches."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def answer(self, examples: Sequence[Example], sampling: Sampling) -> list[list[Reply]]:
        return self.answer_sync(examples, sampling)

    def answer_sync(self, examples: Sequence[Example], sampling: Sampling) -> list[list[Reply]]:
        from service.engine.request import SamplingParams
        from service.openai.chat_output import chat_finish_reason, parse_chat_output
        from service.openai.reasoning import prompt_starts_in_reasoning

        tok = self.engine.tokenizer
        prompts = [tok.apply_chat_template(list(ex.messages), tools=list(ex.tools) or None) for ex in examples]
        params = [
            SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                seed=None if sampling.seed is None else sampling.seed + j,
            )
            for _ in examples
            for j in range(sampling.samples)
        ]
        outs = self.engine.generate([p for p in prompts for _ in range(sampling.samples)], params)
        replies: list[list[Reply]] = []
        for i, (ex, prompt) in enumerate(zip(examples, prompts)):
            row = []
            for out in outs[i * sampling.samples : (i + 1) * sampling.samples]:
                parsed = parse_chat_output(
                    out.text,
                    reasoning_parser="nemotron_3",
                    tool_parser="qwen3_coder",
                    tools=list(ex.tools) or None,
                    starts_in_reasoning=prompt_starts_in_reasoning(prompt),
                )
                calls = tuple(
                    {"name": c.function.name, "arguments": json.loads(c.function.arguments or "{}")}
                    for c in parsed.tool_calls
                )
                row.append(
                    Reply(
                        parsed.content,
                        calls,
                        chat_finish_reason(out.finish_reason, bool(calls)),
                        len(out.prompt_token_ids),
                        out.num_cached_tokens,
                    )
                )
            replies.append(row)
        return replies
