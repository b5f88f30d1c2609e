"""`TrainConfig`: every setting of a training run, declared once, with the staged from-scratch recipe as its
defaults (the committed model came from an earlier two-run recipe; its manifest's `reproduce` spells that out).
`hybrid-serve train-tiny-model` derives one flag per field (name, type, default, help) from it
(service/training/cli.py), and a manifest's `reproduce` command lists the fields that differ from these defaults.

The recipe is staged: recall and state alone on the shortest contexts first (their circuits form there; mixed with
the other tasks from the start, or on full-size contexts, neither leaves chance level), then every task while the
contexts grow to full size, and only then state streams hidden from attention in half of the state steps (the count
must come through the Mamba state).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from dataclasses import dataclass, field
from typing import Any

from service.evals.tasks import GENERATORS, STATE_TRAIN_LENGTHS


def _setting(default: Any, help: str) -> Any:  # noqa: A002  (the metadata key is "help")
    """A field with one line of help; dict defaults are copied per instance."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    seed: int = _setting(0, "seed of the initial weights and of every step's batch")
    steps: int = _setting(6000, "optimizer steps the schedule spans (one task's batch each)")
    batch_size: int = _setting(32, "sequences per step (one task per step)")
    lr: float = _setting(1e-3, "peak AdamW learning rate (linear warm-up, then cosine decay to a twentieth of it)")
    warmup_steps: int = _setting(100, "learning-rate warm-up steps")
    weight_decay: float = _setting(0.01, "AdamW weight decay of the matrices (not of embeddings, norms, biases)")
    mix: dict[str, float] = _setting(
        {"recall": 0.35, "state": 0.3, "addition": 0.25, "comparison": 0.05, "tool": 0.05},
        "task=share,... of the steps from --first-mix-steps on",
    )
    first_mix: dict[str, float] = _setting(
        {"recall": 0.5, "state": 0.5}, "task=share,... of the steps before --first-mix-steps ('': --mix throughout)"
    )
    first_mix_steps: int = _setting(800, "steps that draw their task from --first-mix")
    multi_turn_share: float = _setting(
        0.2, "share of recall/state batches that ask a second question after the first answer"
    )
    eval_num: int = _setting(200, "held-out questions per task for the manifest's accuracy (does not change training)")
    stop_at: int | None = _setting(None, "stop after N steps (the schedule still spans --steps)")
    init_from: str | None = _setting(None, "start from this checkpoint folder's weights (same architecture)")
    state_hidden_share: float = _setting(
        0.5, "share of state steps whose attention layers cannot see the stream from the question on"
    )
    state_hidden_partial: bool = _setting(
        True, "hidden state steps hide each stream from a random point on (attention sees a prefix and undercounts)"
    )
    state_hidden_from: int = _setting(2800, "no state step hides its stream before step N (attention counts first)")
    recall_pairs: tuple[int, int] = _setting((4, 48), "LOW,HIGH key=value pairs of the training recall contexts")
    state_lengths: tuple[int, int] = _setting(STATE_TRAIN_LENGTHS, "LOW,HIGH stream symbols of training state contexts")
    length_bands: bool = _setting(
        True,
        "each recall/state step draws an upper size u and its rows from [u - a tenth of the range, u] (rows of a step "
        "are alike: little padding); off: every row draws from the whole range",
    )
    ramp_from: int = _setting(800, "with --length-bands: u stays in the first tenth of the range until step N")
    ramp_steps: int = _setting(2800, "with --length-bands: u's limit then grows linearly to the whole range by step N")


def parse_mix(text: str) -> dict[str, float]:
    """'recall=0.5,state=0.5' -> {'recall': 0.5, 'state': 0.5} (key order kept: it orders the task draw); '' -> {}."""
    mix: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        task, sep, share = item.partition("=")
        if not sep or task not in GENERATORS:
            raise argparse.ArgumentTypeError(f"expected TASK=SHARE,... with TASK in {sorted(GENERATORS)}, got {text!r}")
        try:
            mix[task] = float(share)
        except ValueError:
            raise argparse.ArgumentTypeError(f"share of {task!r} must be a number, got {share!r}") from None
    return mix


def parse_pair(text: str) -> tuple[int, int]:
    """'4,48' -> (4, 48)."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two integers), got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return low, high


def format_value(value: Any) -> str:
    """A field's value as its flag's argument (parse_mix / parse_pair read it back)."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def value_parser(cls: type, name: str) -> Any:
    """The argparse `type` of field `name` (bool fields: None, they are --x/--no-x switches)."""
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is dict:
        return parse_mix
    if typing.get_origin(hint) is tuple:
        return parse_pair
    base = args[0] if len(args) == 1 else hint  # `int | None` -> int
    if base is bool:
        return None
    if base in (int, float, str):
        return base
    raise TypeError(f"TrainConfig.{name} has type {hint!r}: give it a parser in value_parser")


def differing_flags(cfg: TrainConfig, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags that turn the defaults into `cfg` (fields in `skip` left out), in declaration order."""
    default, flags = TrainConfig(), []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in skip or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags.append(f"{flag} {shlex.quote(format_value(value))}")
    return flags
