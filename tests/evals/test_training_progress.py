"""`service.training.progress` measures a checkpoint: the answer-digit positions are the final answer's digits,
and the shipped trained model (whose manifest records its held-out accuracy) measures as trained while a
random-init model of the same shape measures at chance or worse."""

from __future__ import annotations

import json
import math
import os

from service.evals.tasks import make_examples
from service.training.data import make_batch
from service.training.probe import load
from service.training.progress import answer_positions, main, measure
from service.training.train import build_model


def test_answer_positions_are_the_answer_digits(trained_model):
    _, tok = load(trained_model)
    for task in ("addition", "recall", "state"):
        examples = make_examples(task, 6, 1)
        batch = make_batch(tok, examples, tok.token_to_id("<|pad|>"))
        mask = answer_positions(tok, batch)
        for row, ex in enumerate(examples):
            assert tok.decode(batch.labels[row][mask[row]].tolist()) == ex.answer, (task, ex.answer)


def test_shipped_model_measures_trained_and_random_init_does_not(trained_model, capsys):
    model, tok = load(trained_model)
    with open(os.path.join(trained_model, "manifest.json"), encoding="utf-8") as f:
        shipped = json.load(f)["heldout_greedy_accuracy"]["by_task"]
    examples = make_examples("recall", 20, 0)  # the first 20 of the manifest's 200 held-out questions
    trained = measure(model, tok, examples)
    assert trained.accuracy >= shipped["recall"] - 0.1 and trained.answer_ce < 0.3
    untrained = measure(build_model(tok, seed=0).eval(), tok, examples)
    assert untrained.accuracy == 0.0 and untrained.answer_ce > math.log(10)
    assert main([trained_model, "--num", "4"]) == 0
    report = json.loads(capsys.readouterr().out)["task: [accuracy, answer digit CE]"]
    assert set(report) == {"addition", "comparison", "recall", "state", "tool", "recall_short", "state_short"}
