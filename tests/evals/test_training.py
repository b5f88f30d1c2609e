"""train-tiny-model is reproducible: the same seed gives the same batches and the same weights; the held-out
split never reaches training; what it saves our engine loads with transformers' logits."""

from __future__ import annotations

import dataclasses
import json

import torch

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import heldout, make_examples, state
from service.testing.tiny import tokenizer_config
from service.training.data import attention_mask_hiding, make_batch, train_tokenizer
from service.training.train import TrainConfig, build_model, step_examples, train


def _tokenizer() -> Tokenizer:
    hf = train_tokenizer()
    return Tokenizer(hf, tokenizer_config(hf))


def _addition_only(**kw) -> TrainConfig:
    """A tiny run of addition steps alone (no first stage)."""
    return TrainConfig(batch_size=2, warmup_steps=1, first_mix={}, mix={"addition": 1.0}, **kw)


def test_same_seed_same_weights():
    tok = _tokenizer()
    cfg = _addition_only(seed=3, steps=2)
    a, b = (train(cfg, tok, log=lambda _: None).model.state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = train(_addition_only(seed=4, steps=2), tok, log=lambda _: None).model.state_dict()
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_training_batches_exclude_heldout_pairs():
    cfg = TrainConfig()  # the default recipe: additions from its second stage on
    for step in range(cfg.first_mix_steps, cfg.first_mix_steps + 200):
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


def test_hidden_stream_is_the_stream_and_only_later_positions_lose_it():
    """A hidden-span batch: the span is the `Stream: ... .` text; with the mask, transformers' logits are unchanged
    up to the span's end and change after it (attention no longer sees the stream there)."""
    import random

    tok = _tokenizer()
    rng = random.Random(0)
    examples = [state(rng, "train", turns=2), *make_examples("state", 2, 0)]
    batch = make_batch(tok, examples, tok.token_to_id("<|pad|>"), (0.0, 0.0, 0.5))
    streams = []
    for row, (start, end) in zip(batch.input_ids.tolist(), batch.hidden_spans):
        assert tok.decode(row[start:end]).endswith(".") and tok.decode(row[end : end + 1]) == "\n"
        streams.append(tok.decode(row[:end]).split("Stream: ")[1])
    assert all(
        tok.decode(row[start:end]).startswith("Stream: ")
        for row, (start, end) in zip(batch.input_ids[:2].tolist(), batch.hidden_spans[:2])
    )
    # the third row keeps the first half of its stream visible
    start, end = batch.hidden_spans[2]
    visible = tok.decode(batch.input_ids[2, :start].tolist()).split("Stream: ")[1]
    assert 0.4 < len(visible) / len(streams[2]) < 0.6
    model = build_model(tok, seed=0).eval()
    with torch.no_grad():
        plain = model(input_ids=batch.input_ids).logits
        masks = {"full_attention": attention_mask_hiding(batch), "linear_attention": None}
        hidden = model(input_ids=batch.input_ids, attention_mask=masks).logits
    for i, (_, end) in enumerate(batch.hidden_spans):
        assert torch.allclose(plain[i, :end], hidden[i, :end], atol=1e-5)
        assert (plain[i, end:] - hidden[i, end:]).abs().amax() > 1e-3


def test_length_bands_keep_rows_of_a_step_alike_and_ramp_up():
    """With length bands, a recall step's contexts differ by at most a tenth of the pair range and a state step's
    streams by a tenth of the length range; during the ramp the early steps draw only short contexts; the eval split
    keeps its own sizes (recall 42-48 pairs)."""
    cfg = TrainConfig(
        mix={"recall": 0.5, "state": 0.5},
        first_mix={},
        batch_size=8,
        recall_pairs=(4, 48),
        state_lengths=(40, 260),
        length_bands=True,
        ramp_from=0,
        ramp_steps=100,
        multi_turn_share=0.0,
    )
    seen: dict[str, list[int]] = {"recall": [], "state": []}
    for step in range(300):
        task, examples = step_examples(cfg, step)
        text = [ex.messages[0]["content"] for ex in examples]
        # recall: pairs in the context; state: symbols in the stream
        sizes = [t.count("=") if task == "recall" else len(t.split("\n")[0].split()) - 1 for t in text]
        assert max(sizes) - min(sizes) <= (4 if task == "recall" else 22), (step, task, sizes)
        if step < 10:
            assert max(sizes) <= (4 + 5 if task == "recall" else 40 + 22 + 3), (step, task, sizes)
        seen[task].extend(sizes)
    assert min(seen["recall"]) <= 6 and max(seen["recall"]) >= 46
    assert min(seen["state"]) <= 60 and max(seen["state"]) >= 240
    assert all(42 <= ex.messages[0]["content"].count("=") <= 48 for ex in make_examples("recall", 20, 0))


def test_checkpoint_holds_the_weights_of_a_run_stopped_there(tmp_path):
    """`--checkpoint-every 2` of a 4-step run: OUT/checkpoint loads, says 2 steps, and holds exactly the weights of
    the same run stopped at step 2 (writing it changes nothing: the final weights equal an unchecked run's)."""
    from service.training.cli import run
    from service.training.probe import load

    cfg = _addition_only(seed=5, steps=4, eval_num=2)
    manifest = run(str(tmp_path / "out"), cfg, "cpu", data_workers=0, threads=1, checkpoint_every=2)
    assert manifest["steps_done"] == 4
    with open(tmp_path / "out" / "checkpoint" / "manifest.json", encoding="utf-8") as f:
        assert json.load(f)["steps_done"] == 2
    saved, _ = load(str(tmp_path / "out" / "checkpoint"))
    final, _ = load(str(tmp_path / "out"))
    tok = _tokenizer()
    stopped = train(dataclasses.replace(cfg, stop_at=2), tok, log=lambda _: None).model.state_dict()
    unchecked = train(cfg, tok, log=lambda _: None).model.state_dict()
    assert all(torch.equal(saved.state_dict()[k], stopped[k]) for k in stopped)
    assert all(torch.equal(final.state_dict()[k], unchecked[k]) for k in unchecked)
    assert not all(torch.equal(stopped[k], unchecked[k]) for k in stopped)
    assert not (tmp_path / "out" / "checkpoint.partial").exists()


def test_state_steps_hide_their_stream_only_from_state_hidden_from_on():
    """With `state_hidden_from=40`, no step before 40 hides a stream and about `state_hidden_share` of the later state
    steps do; every step's task and examples are those of the same recipe without the delay."""
    from service.training.train import _step_plan

    base = TrainConfig(
        mix={"state": 0.5, "addition": 0.5}, first_mix={}, batch_size=2, state_hidden_share=0.5, state_hidden_from=0
    )
    delayed = dataclasses.replace(base, state_hidden_from=40)
    hidden_steps = []
    for step in range(200):
        task, examples, visible = _step_plan(delayed, step)
        assert (task, examples) == _step_plan(base, step)[:2]
        if visible is not None:
            assert task == "state" and step >= 40
            hidden_steps.append(step)
            assert _step_plan(base, step)[2] == visible
    state_steps_after = sum(_step_plan(base, s)[0] == "state" for s in range(40, 200))
    assert 0.3 * state_steps_after <= len(hidden_steps) <= 0.7 * state_steps_after


def test_first_mix_and_ramp_from_hold_short_recall_and_state_first():
    """`first_mix` picks the tasks of the first `first_mix_steps` steps; with `ramp_from` the contexts stay in the
    shortest band (recall 4-8 pairs) until then and reach the whole range (up to 48) by `ramp_steps`."""
    cfg = TrainConfig(
        mix={"addition": 0.5, "tool": 0.5},
        first_mix={"recall": 1.0},
        first_mix_steps=60,
        batch_size=4,
        recall_pairs=(4, 48),
        length_bands=True,
        ramp_from=60,
        ramp_steps=120,
        multi_turn_share=0.0,
    )
    early = [step_examples(cfg, s) for s in range(60)]
    assert {task for task, _ in early} == {"recall"}
    assert max(ex.messages[0]["content"].count("=") for _, exs in early for ex in exs) <= 8
    assert {step_examples(cfg, s)[0] for s in range(60, 160)} == {"addition", "tool"}
    late = dataclasses.replace(cfg, mix={"recall": 1.0})
    sizes = [ex.messages[0]["content"].count("=") for s in range(120, 200) for ex in step_examples(late, s)[1]]
    assert max(sizes) >= 44


def test_two_workers_train_the_weights_of_one(tmp_path):
    """Data-parallel training (2 processes, each on half of every step's rows, gradients summed over 127.0.0.1)
    ends at the weights of the same recipe in one process, up to float summation order; the manifest's command
    names the workers."""
    from safetensors.torch import load_file

    from service.training.cli import run

    cfg = TrainConfig(
        batch_size=4,
        steps=3,
        warmup_steps=1,
        first_mix={},
        mix={"state": 0.5, "addition": 0.5},
        state_hidden_from=0,
        state_hidden_share=1.0,
        eval_num=2,
    )
    weights = {}
    for workers in (1, 2):
        manifest = run(str(tmp_path / str(workers)), cfg, "cpu", 0, 1, workers=workers)
        weights[workers] = load_file(str(tmp_path / str(workers) / "model.safetensors"))
        assert manifest["workers"] == workers and manifest["steps_done"] == 3
    assert "--workers 2" in manifest["reproduce"]
    start = build_model(_tokenizer(), cfg.seed).state_dict()
    moved = [k for k in weights[1] if k in start and not torch.equal(weights[1][k], start[k])]
    assert moved, "the run must change the weights for the comparison to mean anything"
    for k in weights[1]:
        torch.testing.assert_close(weights[2][k], weights[1][k], rtol=1e-4, atol=1e-5)
