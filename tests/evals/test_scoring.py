"""pass@1 / pass@k / majority@k / no-answer / truncated arithmetic, on hand-made replies; task answer keys."""

from __future__ import annotations

import random

import pytest

from service.evals.harness import Reply, score
from service.evals.tasks import TASKS, extract_answer, heldout, make_examples


def _reply(content, finish="stop", prompt=10, cached=0):
    return Reply(content, (), finish, prompt, cached)


def test_score_counts():
    examples = make_examples("addition", 3, 0)
    a = [ex.answer for ex in examples]
    replies = [
        [_reply(a[0]), _reply(a[0]), _reply("12345")],  # 2/3 right, majority right
        [_reply("1"), _reply("2"), _reply(a[1])],  # 1/3, tie -> first seen ("1"): wrong
        [_reply(None, "length", cached=10), _reply("no digits"), _reply("7")],  # none right
    ]
    s = score("addition", examples, replies)
    assert s.num == 3 and s.samples == 3
    assert s.pass_at_1 == pytest.approx((2 / 3 + 1 / 3 + 0) / 3)
    assert s.pass_at_k == pytest.approx(2 / 3) and s.majority_at_k == pytest.approx(1 / 3)
    assert s.no_answer == 2 and s.truncated == 1 and s.hit_ratio == pytest.approx(10 / 90)


def test_answers_are_correct_and_heldout_is_disjoint():
    for ex in make_examples("addition", 50, 0):
        a, b = map(int, ex.messages[0]["content"][len("What is ") : -1].split("+"))
        assert heldout(a, b) and int(ex.answer) == a + b and a >= 100 and b >= 100
    rng = random.Random(0)
    from service.evals.tasks import addition

    assert not any(heldout(*map(int, addition(rng).messages[0]["content"][8:-1].split("+"))) for _ in range(500))
    for ex in make_examples("state", 20, 0):
        stream = ex.messages[0]["content"].split("\n")[0]
        mark = ex.messages[-1]["content"].split("\n")[-1][len("How many ") : -1]
        assert stream.split().count(mark) == int(ex.answer)
    for ex in make_examples("recall", 20, 0):
        key = ex.messages[0]["content"].split("\n")[-1][len("What is ") : -1]
        assert f" {key}={ex.answer}" in ex.messages[0]["content"]


def test_extract_answer():
    assert extract_answer("addition", "The sum is 839.") == "839"
    assert extract_answer("state", None) is None
    assert extract_answer("tool", None, [{"name": "add", "arguments": {"a": 1, "b": 2}}]) == "add(1,2)"
    assert set(TASKS) == {"addition", "comparison", "recall", "state", "tool"}
