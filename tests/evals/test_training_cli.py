"""`hybrid-serve train-tiny-model`'s flags are TrainConfig's fields: with no flags the run is TrainConfig()'s
recipe (the staged from-scratch one), a manifest's `reproduce` command parses back to the run's config, and the same
command gives the same loss at every step (whatever the number of data workers)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex

import pytest

from service.engine.tokenizer import Tokenizer
from service.testing.tiny import tokenizer_config
from service.training.cli import add_cli, config_from_args, reproduce_chain, reproduce_command
from service.training.config import TrainConfig
from service.training.data import train_tokenizer
from service.training.train import train


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-serve")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train-tiny-model", *argv])


def test_no_flags_is_the_default_recipe():
    args = _parse(["OUT"])
    assert config_from_args(args) == TrainConfig()
    assert (args.out, args.threads, args.data_workers, args.checkpoint_every) == ("OUT", 2, 1, 0)
    assert reproduce_command(TrainConfig(), threads=1, steps_done=TrainConfig().steps) == (
        "hybrid-serve train-tiny-model OUT --seed 0 --threads 1"
    )


def test_reproduce_command_parses_back_to_the_config():
    """A config that differs from the defaults in every field: its command, parsed, is that config (a run stopped
    early is reproduced with --stop-at its steps)."""
    changed = TrainConfig(
        seed=1,
        steps=10,
        batch_size=3,
        lr=0.002,
        warmup_steps=5,
        weight_decay=0.1,
        mix={"addition": 0.75, "tool": 0.25},
        first_mix={},
        first_mix_steps=0,
        multi_turn_share=0.0,
        eval_num=4,
        stop_at=7,
        init_from="some dir/ckpt",
        state_hidden_share=0.0,
        state_hidden_partial=False,
        state_hidden_from=0,
        recall_pairs=(42, 48),
        state_lengths=(50, 60),
        length_bands=False,
        ramp_from=0,
        ramp_steps=0,
    )
    default = TrainConfig()
    assert all(getattr(changed, f.name) != getattr(default, f.name) for f in dataclasses.fields(TrainConfig))
    command = reproduce_command(changed, threads=3, steps_done=7)
    assert command.startswith("hybrid-serve train-tiny-model OUT --seed 1 ") and command.endswith(" --stop-at 7")
    args = _parse(shlex.split(command)[2:])
    assert config_from_args(args) == changed and args.threads == 3
    assert "--no-length-bands" in command.split()


def test_reproduce_chain_names_the_folder_each_run_continues_from():
    """A run continued from BASE (itself continued from a random-weights run) lists all three commands; each but the
    last writes the folder the next one starts from."""
    first = reproduce_command(TrainConfig(), threads=1, steps_done=TrainConfig().steps)
    second = reproduce_command(TrainConfig(init_from="A 0", steps=10), threads=1, steps_done=10)
    third = reproduce_command(TrainConfig(init_from="BASE", steps=5), threads=1, steps_done=5)
    chain = reproduce_chain(
        {"reproduce": second, "reproduce_chain": [first.replace(" OUT ", " 'A 0' "), second]}, "BASE"
    )
    assert [*chain, third] == [
        "hybrid-serve train-tiny-model 'A 0' --seed 0 --threads 1",
        "hybrid-serve train-tiny-model BASE --seed 0 --steps 10 --init-from 'A 0' --threads 1",
        "hybrid-serve train-tiny-model OUT --seed 0 --steps 5 --init-from BASE --threads 1",
    ]
    assert reproduce_chain({"reproduce": first}, "A 0") == [chain[0]]
    outs = [_parse(shlex.split(c)[2:]).out for c in chain]
    assert outs == ["A 0", "BASE"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mix", "recall:0.5"], "TASK=SHARE"),
        (["--mix", "recal=1"], "'recall'"),
        (["--first-mix", "recall=half"], "must be a number"),
        (["--recall-pairs", "48,4"], "0 < LOW <= HIGH"),
        (["--state-lengths", "40"], "LOW,HIGH"),
        (["--steps", "many"], "--steps"),
    ],
)
def test_bad_values_name_what_to_change(flags, message, capsys):
    with pytest.raises(SystemExit):
        _parse(["OUT", *flags])
    assert message in capsys.readouterr().err


def test_same_command_same_loss_at_every_step():
    """The default recipe's first steps (batch 2): the same per-step losses with the batches built in the training
    process or by 2 data workers; another seed gives others."""
    hf = train_tokenizer()
    tok = Tokenizer(hf, tokenizer_config(hf))
    cfg = config_from_args(_parse(["OUT", "--batch-size", "2", "--stop-at", "4"]))
    runs = [train(cfg, tok, data_workers=workers, log=lambda _: None).step_losses for workers in (0, 2)]
    assert len(runs[0]) == 4 and all(math.isfinite(x) and x > 0 for x in runs[0])
    assert runs[0] == runs[1]
    other = train(dataclasses.replace(cfg, seed=1, stop_at=1), tok, log=lambda _: None).step_losses
    assert other[0] != runs[0][0]
