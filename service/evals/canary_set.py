"""The accuracy canary's pinned questions: held-out questions of the trained tasks, with their answers.

Two each of `addition`, `recall` and `state` (the recall and state contexts are >= 256 tokens, so a cached run
resumes from a snapshot several grid points in). The shipped model answers all six correctly without a cache
(tests/evals/test_canary_answers.py), so on it any answer accuracy below 1 is a regression.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import MAX_TOKENS, extract_answer, make_examples
from service.openai.reasoning import parse as parse_reasoning

CANARY_SEED = 8
CANARY_TASKS = ("addition", "recall", "state")


@dataclass(frozen=True)
class PinnedQuestion:
    task: str
    prompt_ids: tuple[int, ...]  # the chat-templated question (generation prompt included)
    answer: str  # the correct final answer
    max_tokens: int  # reply budget


def pinned_questions(tokenizer: Tokenizer, per_task: int = 2) -> list[PinnedQuestion]:
    """Empty when the tokenizer has no chat template (the canary then compares cached and cold runs only)."""
    if tokenizer.chat_template is None:
        return []
    out = []
    for task in CANARY_TASKS:
        for ex in make_examples(task, per_task, CANARY_SEED):
            prompt = tokenizer.apply_chat_template(list(ex.messages))
            out.append(PinnedQuestion(task, tuple(tokenizer.encode(prompt)), ex.answer, MAX_TOKENS[task]))
    return out


def is_correct(question: PinnedQuestion, generated_text: str, starts_in_reasoning: bool = True) -> bool:
    """Whether a greedy reply (text after the generation prompt) states the question's answer."""
    _, content = parse_reasoning(generated_text.replace("<|im_end|>", ""), starts_in_reasoning)
    return extract_answer(question.task, content) == question.answer
