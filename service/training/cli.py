"""`hybrid-serve train-tiny-model OUT`: train, measure held-out accuracy, write the checkpoint folder.

The folder: `config.json` + `model.safetensors` (transformers' `save_pretrained`), `tokenizer.json`,
`tokenizer_config.json` (the tiny model's chat template), `generation_config.json` and `manifest.json`
(model config, data recipe, seed, steps, final losses, held-out greedy accuracy, wall time, device)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import signal
import sys
import threading
import time
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from service.engine.tokenizer import Tokenizer
from service.testing.tiny import tokenizer_config
from service.training.data import TOKENIZER_VOCAB_SIZE, train_tokenizer
from service.training.probe import state_accuracy_ablations
from service.training.train import MODEL_OVERRIDES, TrainConfig, heldout_accuracy, train

DATA_RECIPE = (
    "service/evals/tasks.py generators, train split (addition/comparison operand pairs with "
    "heldout(a, b) excluded); step i's batch from random.Random(f'{seed}/{i}'); loss on replies only"
)


def write_folder(out: str, model: Any, tokenizer_json: Any, manifest: dict[str, Any]) -> None:
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_json.save(os.path.join(out, "tokenizer.json"))
    cfg = model.config
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    for name, payload in (
        ("tokenizer_config.json", tokenizer_config(tokenizer_json)),
        ("generation_config.json", generation),
        ("manifest.json", manifest),
    ):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, ensure_ascii=False)
            f.write("\n")


def write_checkpoint(out: str, tokenizer_json: Any, cfg: TrainConfig, steps_done: int, model: Any) -> None:
    """Replace `out`/checkpoint with the weights after `steps_done` steps (a loadable folder; its manifest has no
    accuracy: measure it with `heldout_accuracy`). Written beside and renamed, so a reader never sees half of it."""
    final, scratch = os.path.join(out, "checkpoint"), os.path.join(out, "checkpoint.partial")
    shutil.rmtree(scratch, ignore_errors=True)
    write_folder(scratch, model, tokenizer_json, {"train_config": dataclasses.asdict(cfg), "steps_done": steps_done})
    shutil.rmtree(final, ignore_errors=True)
    os.rename(scratch, final)


def run(
    out: str, cfg: TrainConfig, device: str, data_workers: int, threads: int, checkpoint_every: int = 0
) -> dict[str, Any]:
    """Train (SIGTERM ends training early and still writes the folder), measure, write `out`; every
    `checkpoint_every` steps (0: never) the weights so far go to `out`/checkpoint."""
    torch.set_num_threads(threads)
    # continuing from a checkpoint keeps its tokenizer (its embeddings are indexed by those ids)
    hf_tokenizer = (
        HFTokenizer.from_file(os.path.join(cfg.init_from, "tokenizer.json")) if cfg.init_from else train_tokenizer()
    )
    tokenizer = Tokenizer(hf_tokenizer, tokenizer_config(hf_tokenizer))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    start, cpu_start, load_start = time.monotonic(), _cpu_s(), os.getloadavg()[0]
    result = train(
        cfg,
        tokenizer,
        device,
        data_workers,
        should_stop=stop.is_set,
        checkpoint_every=checkpoint_every,
        on_checkpoint=lambda steps_done, model: write_checkpoint(out, hf_tokenizer, cfg, steps_done, model),
    )
    train_s, train_cpu_s, load_end = time.monotonic() - start, _cpu_s() - cpu_start, os.getloadavg()[0]
    accuracy = heldout_accuracy(result.model, tokenizer, cfg.eval_num, device)
    ablations = state_accuracy_ablations(result.model, tokenizer, cfg.eval_num, device)
    rerun = (
        f"hybrid-serve train-tiny-model OUT --seed {cfg.seed} --steps {cfg.steps} --batch-size {cfg.batch_size} "
        f"--lr {cfg.lr} --mix "
        + ",".join(f"{k}={v}" for k, v in cfg.mix.items())
        + (
            " --first-mix "
            + ",".join(f"{k}={v}" for k, v in cfg.first_mix.items())
            + f" --first-mix-steps {cfg.first_mix_steps}"
            if cfg.first_mix
            else ""
        )
        + (f" --init-from {cfg.init_from}" if cfg.init_from else "")
        + (f" --state-hidden-share {cfg.state_hidden_share}" if cfg.state_hidden_share else "")
        + (" --state-hidden-partial" if cfg.state_hidden_partial else "")
        + (f" --state-hidden-from {cfg.state_hidden_from}" if cfg.state_hidden_from else "")
        + _size_flags(cfg)
        + (f" --stop-at {result.steps_done}" if result.steps_done < cfg.steps else "")
    )
    manifest = {
        "train_config": dataclasses.asdict(cfg),
        "steps_done": result.steps_done,
        "reproduce": rerun,
        "model_overrides": MODEL_OVERRIDES,
        "tokenizer": {"vocab_size": tokenizer.vocab_size, "bpe_target_vocab": TOKENIZER_VOCAB_SIZE},
        "data_recipe": DATA_RECIPE,
        "final_loss": result.final_loss,
        "heldout_greedy_accuracy": {
            "num_per_task": cfg.eval_num,
            "eval_seed": 0,
            "by_task": accuracy,
            "method": "teacher-forced: every reply token is the argmax",
            "state_attention_blind": ablations["attention_blind"],
        },
        "train_wall_s": round(train_s, 1),
        # process CPU time of training (all torch threads, plus the data workers once they have exited)
        "train_cpu_s": round(train_cpu_s, 1),
        "load_average_1m": [round(load_start, 2), round(load_end, 2)],  # at the start and at the end of training
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    previous = os.path.join(cfg.init_from or "", "manifest.json")
    if cfg.init_from and os.path.isfile(previous):
        with open(previous, encoding="utf-8") as f:
            manifest["init_manifest"] = json.load(f)
    write_folder(out, result.model.to("cpu"), hf_tokenizer, manifest)
    return manifest


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its exited children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _size_flags(cfg: TrainConfig) -> str:
    """The reproduce command's flags for the training context sizes (only those that differ from the defaults)."""
    d, flags = TrainConfig(), ""
    if cfg.warmup_steps != min(d.warmup_steps, cfg.steps // 10):
        flags += f" --warmup-steps {cfg.warmup_steps}"
    if cfg.recall_pairs != d.recall_pairs:
        flags += " --recall-pairs {},{}".format(*cfg.recall_pairs)
    if cfg.state_lengths != d.state_lengths:
        flags += " --state-lengths {},{}".format(*cfg.state_lengths)
    if cfg.length_bands:
        flags += " --length-bands"
    if cfg.ramp_steps:
        flags += f" --ramp-steps {cfg.ramp_steps}"
    if cfg.ramp_from:
        flags += f" --ramp-from {cfg.ramp_from}"
    return flags


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return low, high


def _mix(text: str) -> dict[str, float]:
    """'recall=0.5,state=0.5' -> {'recall': 0.5, 'state': 0.5}."""
    return {task: float(share) for task, share in (item.split("=") for item in text.split(","))}


def _run_cli(args: argparse.Namespace) -> int:
    mix = TrainConfig().mix if args.mix is None else _mix(args.mix)
    cfg = TrainConfig(
        seed=args.seed,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        stop_at=args.stop_at,
        init_from=args.init_from,
        state_hidden_share=args.state_hidden_share,
        state_hidden_partial=args.state_hidden_partial,
        state_hidden_from=args.state_hidden_from,
        mix=mix,
        first_mix=_mix(args.first_mix) if args.first_mix else {},
        first_mix_steps=args.first_mix_steps,
        warmup_steps=min(TrainConfig().warmup_steps, args.steps // 10)
        if args.warmup_steps is None
        else args.warmup_steps,
        recall_pairs=args.recall_pairs,
        state_lengths=args.state_lengths,
        length_bands=args.length_bands,
        ramp_steps=args.ramp_steps,
        ramp_from=args.ramp_from,
    )
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    manifest = run(args.out, cfg, device, args.data_workers, args.threads, args.checkpoint_every)
    print(
        json.dumps(
            {
                "out": args.out,
                "final_loss": manifest["final_loss"],
                "accuracy": manifest["heldout_greedy_accuracy"]["by_task"],
                "state_attention_blind": manifest["heldout_greedy_accuracy"]["state_attention_blind"],
                "steps_done": manifest["steps_done"],
                "train_wall_s": manifest["train_wall_s"],
                "train_cpu_s": manifest["train_cpu_s"],
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m service.training.cli OUT ...`: the subcommand without the other subcommands' imports."""
    parser = argparse.ArgumentParser(prog="train-tiny-model")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train-tiny-model", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


def add_cli(subparsers: Any) -> None:
    """Register `train-tiny-model OUT [--steps N --batch-size B --lr X --seed S --device D]`."""
    d = TrainConfig()
    p = subparsers.add_parser("train-tiny-model", help="train the tiny NemotronH on the synthetic tasks")
    p.add_argument("out", metavar="OUT", help="output checkpoint folder (created if missing)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (one task's batch each)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument("--init-from", default=None, help="continue from this checkpoint folder (same architecture)")
    p.add_argument(
        "--mix",
        default=None,
        help="task shares, e.g. state=0.7,recall=0.1,addition=0.1,comparison=0.05,"
        "tool=0.05 (default: the built-in mix)",
    )
    p.add_argument(
        "--first-mix",
        default=None,
        help="task shares of the steps before --first-mix-steps, e.g. recall=0.5,state=0.5 (default: --mix throughout)",
    )
    p.add_argument("--first-mix-steps", type=int, default=d.first_mix_steps, help="steps that draw from --first-mix")
    p.add_argument(
        "--state-hidden-share",
        type=float,
        default=d.state_hidden_share,
        help="share of state-task steps whose attention cannot see the stream from the question on",
    )
    p.add_argument(
        "--state-hidden-partial",
        action="store_true",
        help="hidden state steps hide each stream from a random point on (attention sees a random prefix of it)",
    )
    p.add_argument(
        "--state-hidden-from",
        type=int,
        default=d.state_hidden_from,
        help="no state step hides its stream before step N (the count is learned with attention first)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="learning-rate warm-up steps (default: min(200, steps/10))"
    )
    p.add_argument(
        "--recall-pairs",
        type=_pair,
        default=d.recall_pairs,
        help="LOW,HIGH key=value pairs of training recall contexts",
    )
    p.add_argument(
        "--state-lengths",
        type=_pair,
        default=d.state_lengths,
        help="LOW,HIGH stream symbols of training state contexts",
    )
    p.add_argument(
        "--length-bands",
        action="store_true",
        help="each recall/state step's rows have similar sizes (a tenth of the range ending at a drawn size)",
    )
    p.add_argument(
        "--ramp-steps",
        type=int,
        default=d.ramp_steps,
        help="with --length-bands: the drawn size's upper limit grows from a tenth of the range to all of it by step N",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write the weights so far to OUT/checkpoint every N steps (0: never); does not change the training",
    )
    p.add_argument(
        "--ramp-from",
        type=int,
        default=d.ramp_from,
        help="with --length-bands: the shortest band until step N, then the ramp up to --ramp-steps",
    )
    p.add_argument("--stop-at", type=int, default=None, help="stop after N steps (the schedule spans --steps)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the initial weights and the data")
    p.add_argument("--device", default="auto", help="torch device: auto (cuda if available), cpu, cuda")
    p.add_argument("--data-workers", type=int, default=1, help="processes that build batches ahead")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.set_defaults(func=_run_cli)


if __name__ == "__main__":
    sys.exit(main())
