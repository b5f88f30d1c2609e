"""train-tiny-model is reproducible: the same seed gives the same batches and the same weights; the held-out
split never reaches training; what it saves our engine loads with transformers' logits."""

from __future__ import annotations

import torch

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import heldout
from service.testing.tiny import tokenizer_config
from service.training.data import train_tokenizer
from service.training.train import TrainConfig, step_examples, train


def _tokenizer() -> Tokenizer:
    hf = train_tokenizer()
    return Tokenizer(hf, tokenizer_config(hf))


def test_same_seed_same_weights():
    tok = _tokenizer()
    cfg = TrainConfig(seed=3, steps=2, batch_size=2, warmup_steps=1, mix={"addition": 1.0})
    a, b = (train(cfg, tok, log=lambda _: None).model.state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = train(
        TrainConfig(seed=4, steps=2, batch_size=2, warmup_steps=1, mix={"addition": 1.0}), tok, log=lambda _: None
    ).model.state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_batches_exclude_heldout_pairs():
    cfg = TrainConfig()
    for step in range(200):
        task, examples = step_examples(cfg, step)
        assert step_examples(cfg, step)[1] == examples
        if task == "addition":
            for ex in examples:
                a, b = map(int, ex.messages[0]["content"][len("What is ") : -1].split("+"))
                assert not heldout(a, b)


def test_digits_and_keys_are_single_tokens():
    tok = _tokenizer()
    assert [tok.decode([i]) for i in tok.encode("482+357")] == list("482+357")
    assert len(tok.encode(" tiger")) == 1 and tok.token_to_id("<think>") is not None
