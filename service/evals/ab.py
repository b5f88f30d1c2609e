"""Cache A/B: the same cache-stressing workload against one backend per prefix-cache strategy.

The workload (`ab_rounds`) is three rounds; each round's requests are sent together, so an engine packs them
into shared batches of unaligned lengths (long contexts next to short additions):
1. first questions about `num_contexts` recall and `num_contexts` state contexts (>= 256 tokens each), after
   `2 * num_contexts` short additions (each one's length is no multiple of the chunk size, so the contexts'
   chunks start at offsets a `cumsum(len // chunk)` indexing gets wrong);
2. a second question about each context (its prefix is cached: the state must resume from a snapshot);
3. multi-turn: the first question, its reasoning and answer (what the model wrote in round 1, when it was
   right), then a third question (the whole first exchange is cached, also for `no_buffer`).
Greedy decoding, so every strategy must give identical answers; the accuracy per strategy and task and each
strategy's hit ratio (cached prompt tokens / prompt tokens) are reported.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from service.evals.harness import Backend, Reply, Sampling, TaskScore, score
from service.evals.tasks import MAX_TOKENS, Example, addition, conversation, recall_questions, state_questions

STRATEGIES = ("off", "no_buffer", "extra_buffer")


def ab_rounds(num_contexts: int, seed: int = 0) -> list[list[Example]]:
    """Three rounds of examples (see the module docstring); deterministic in (num_contexts, seed)."""
    rng = random.Random(f"ab/{seed}")
    families = []
    for _ in range(num_contexts):
        families.append(("recall", *recall_questions(rng, 3)))
        families.append(("state", *state_questions(rng, 3)))
    rounds: list[list[Example]] = [[addition(rng, "eval") for _ in range(2 * num_contexts)] for _ in range(3)]
    for task, context, qa in families:
        rounds[0].append(conversation(task, context, qa[:1]))
        rounds[1].append(conversation(task, context, qa[1:2]))
        rounds[2].append(conversation(task, context, [qa[0], qa[2]], history_reasoning=True))
    return rounds


@dataclass(frozen=True)
class ABResult:
    strategy: str
    scores: dict[str, TaskScore]  # task -> score over all rounds
    hit_ratio: float  # cached prompt tokens / prompt tokens over the whole workload
    answers: tuple[str | None, ...]  # every reply's extracted answer, in workload order (greedy: comparable)

    def rows(self) -> list[str]:
        return [
            f"{self.strategy:<13} {s.task:<9} accuracy={s.pass_at_1:.3f} (n={s.num}) hit_ratio={self.hit_ratio:.3f}"
            for s in self.scores.values()
        ]


async def run_ab(backends: Mapping[str, Backend], num_contexts: int = 8, seed: int = 0) -> list[ABResult]:
    """The workload against each backend (named by strategy), one after the other."""
    from service.evals.tasks import extract_answer

    rounds = ab_rounds(num_contexts, seed)
    results = []
    for strategy, backend in backends.items():
        by_task: dict[str, tuple[list[Example], list[list[Reply]]]] = {}
        answers: list[str | None] = []
        prompt = cached = 0
        for examples in rounds:
            replies = await backend.answer(examples, Sampling(max_tokens=max(MAX_TOKENS[e.task] for e in examples)))
            for ex, reps in zip(examples, replies):
                exs, rs = by_task.setdefault(ex.task, ([], []))
                exs.append(ex)
                rs.append(reps)
                answers.append(extract_answer(ex.task, reps[0].content, list(reps[0].tool_calls)))
                prompt += reps[0].prompt_tokens
                cached += reps[0].cached_tokens
        scores = {task: score(task, exs, rs) for task, (exs, rs) in sorted(by_task.items())}
        results.append(ABResult(strategy, scores, cached / max(1, prompt), tuple(answers)))
    return results
