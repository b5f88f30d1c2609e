"""lm-evaluation-harness datasets for the hybrid_* tasks, generated locally (no download): the held-out split of
service/evals/tasks.py, one single-turn question per document."""

from __future__ import annotations

from typing import Any

import datasets

from service.evals.tasks import make_examples


def _load(task: str, num: int = 200, seed: int = 0, **_: Any) -> datasets.DatasetDict:
    rows = [{"question": ex.messages[-1]["content"], "answer": ex.answer} for ex in make_examples(task, num, seed)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_addition(**kw: Any) -> datasets.DatasetDict:
    return _load("addition", **kw)


def load_recall(**kw: Any) -> datasets.DatasetDict:
    return _load("recall", **kw)


def load_state(**kw: Any) -> datasets.DatasetDict:
    return _load("state", **kw)
