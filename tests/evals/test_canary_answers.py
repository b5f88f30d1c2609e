"""The canary's pinned questions: on the shipped model every cached run answers correctly and agrees with the
cold run; the answer check itself rejects a wrong reply."""

from __future__ import annotations

import asyncio

from service.engine import AsyncEngine, EngineConfig
from service.engine.canary import pinned_canary
from service.evals.canary_set import CANARY_TASKS, is_correct, pinned_questions


def test_pinned_questions_are_answered_correctly_from_the_cache(trained_model):

    async def main():
        engine = AsyncEngine(
            EngineConfig(
                model_path=trained_model, kernel_backend="torch", page_size=16, mamba_cache_strategy="extra_buffer"
            )
        )
        try:
            questions = pinned_questions(engine.engine.tokenizer)
            checks = [await pinned_canary(engine, q.prompt_ids, q.max_tokens, ignore_eos=False) for q in questions]
            return questions, checks
        finally:
            await engine.shutdown(drain_timeout_s=1)

    questions, checks = asyncio.run(main())
    assert [q.task for q in questions] == [t for t in CANARY_TASKS for _ in range(2)]
    assert all(len(q.prompt_ids) >= {"addition": 10, "recall": 256, "state": 200}[q.task] for q in questions)
    for q, check in zip(questions, checks):
        assert not check.mismatch and check.token_agreement == 1.0, check
        assert check.num_cached_tokens > 0, check
        assert is_correct(q, check.text), (q.task, q.answer, check.text)
        wrong = check.text.replace(q.answer, str(int(q.answer) + 1))
        assert not is_correct(q, wrong)
