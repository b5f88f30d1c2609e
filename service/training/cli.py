"""`hybrid-serve train-tiny-model OUT`: train, measure held-out accuracy, write the checkpoint folder.

The folder: `config.json` + `model.safetensors` (transformers' `save_pretrained`), `tokenizer.json`,
`tokenizer_config.json` (the tiny model's chat template), `generation_config.json` and `manifest.json`
(model config, data recipe, seed, steps, final losses, held-out greedy accuracy, wall time, device). A run that
continues from another folder (`--init-from`) keeps that folder's manifest (`init_manifest`) and lists every
command from random weights in order (`reproduce_chain`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer

from service.engine.tokenizer import Tokenizer
from service.testing.tiny import tokenizer_config
from service.training.config import TrainConfig, differing_flags, format_value, parse_mix, parse_pair, value_parser
from service.training.data import TOKENIZER_VOCAB_SIZE, train_tokenizer
from service.training.parallel import Shard, host_store, join_store, start_group, stop_group
from service.training.probe import state_accuracy_ablations
from service.training.train import MODEL_OVERRIDES, heldout_accuracy, train

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
    out: str,
    cfg: TrainConfig,
    device: str,
    data_workers: int,
    threads: int,
    checkpoint_every: int = 0,
    workers: int = 1,
) -> dict[str, Any]:
    """Train (SIGTERM ends training early and still writes the folder), measure, write `out`; every
    `checkpoint_every` steps (0: never) the weights so far go to `out`/checkpoint. `workers` > 1 trains data-parallel
    over that many processes (this one is worker 0; service/training/parallel.py)."""
    torch.set_num_threads(threads)
    # continuing from a checkpoint keeps its tokenizer (its embeddings are indexed by those ids)
    hf_tokenizer = (
        HFTokenizer.from_file(os.path.join(cfg.init_from, "tokenizer.json")) if cfg.init_from else train_tokenizer()
    )
    tokenizer = Tokenizer(hf_tokenizer, tokenizer_config(hf_tokenizer))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    start, cpu_start, load_start = time.monotonic(), _cpu_s(), os.getloadavg()[0]
    with _worker_group(cfg, hf_tokenizer, device, data_workers, threads, workers) as shard:
        result = train(
            cfg,
            tokenizer,
            device,
            data_workers,
            should_stop=stop.is_set,
            checkpoint_every=checkpoint_every,
            on_checkpoint=lambda steps_done, model: write_checkpoint(out, hf_tokenizer, cfg, steps_done, model),
            shard=shard,
        )
    train_s, train_cpu_s, load_end = time.monotonic() - start, _cpu_s() - cpu_start, os.getloadavg()[0]
    accuracy = heldout_accuracy(result.model, tokenizer, cfg.eval_num, device)
    ablations = state_accuracy_ablations(result.model, tokenizer, cfg.eval_num, device)
    rerun = reproduce_command(cfg, threads, result.steps_done, workers)
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
        # process CPU time of training (all torch threads, plus the data and training workers once they have exited)
        "train_cpu_s": round(train_cpu_s, 1),
        "load_average_1m": [round(load_start, 2), round(load_end, 2)],  # at the start and at the end of training
        "device": device if device == "cpu" else torch.cuda.get_device_name(),
        "threads": threads,  # torch threads per worker
        "workers": workers,  # data-parallel training processes
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    previous = os.path.join(cfg.init_from or "", "manifest.json")
    if cfg.init_from and os.path.isfile(previous):
        with open(previous, encoding="utf-8") as f:
            manifest["init_manifest"] = json.load(f)
        manifest["reproduce_chain"] = reproduce_chain(manifest["init_manifest"], cfg.init_from) + [rerun]
    write_folder(out, result.model.to("cpu"), hf_tokenizer, manifest)
    return manifest


@contextlib.contextmanager
def _worker_group(
    cfg: TrainConfig, hf_tokenizer: Any, device: str, data_workers: int, threads: int, workers: int
) -> Iterator[Shard]:
    """Worker 0's shard; with `workers` > 1 the other workers run in spawned processes for the `with` block and
    are joined at its end (their CPU time then counts in this process' children's)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if workers == 1:
        yield Shard()
        return
    store = host_store(workers)
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_train_worker,
            args=(cfg, hf_tokenizer.to_str(), device, data_workers, threads, rank, workers, store.port),
            daemon=True,
        )
        for rank in range(1, workers)
    ]
    for p in procs:
        p.start()
    shard = start_group(0, workers, store)
    try:
        yield shard
    finally:
        stop_group(shard)
        for p in procs:
            p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a training worker failed (exit codes {[p.exitcode for p in procs]}); see its output")


def _train_worker(
    cfg: TrainConfig,
    tokenizer_json: str,
    device: str,
    data_workers: int,
    threads: int,
    rank: int,
    world: int,
    port: int,
) -> None:
    """Worker `rank` > 0: train on its rows of every step in lockstep with worker 0, then exit (SIGTERM is worker
    0's to handle: it ends every worker at the same step)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    hf_tokenizer = HFTokenizer.from_str(tokenizer_json)
    shard = start_group(rank, world, join_store(port, world))
    try:
        train(cfg, Tokenizer(hf_tokenizer, tokenizer_config(hf_tokenizer)), device, data_workers, shard=shard)
    finally:
        stop_group(shard)


def _cpu_s() -> float:
    """User + system CPU seconds of this process and of its exited children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def reproduce_command(cfg: TrainConfig, threads: int, steps_done: int, workers: int = 1) -> str:
    """The command that trains `cfg` again: the seed, the fields that differ from the defaults, the torch threads
    and training workers (float sums may round differently with others) and, for a run stopped early, `--stop-at`
    its steps."""
    skip = ("seed", "stop_at")
    stop = f" --stop-at {steps_done}" if steps_done < cfg.steps else ""
    machine = [f"--threads {threads}"] + ([f"--workers {workers}"] if workers > 1 else [])
    flags = " ".join([f"--seed {cfg.seed}", *differing_flags(cfg, skip), *machine])
    return f"hybrid-serve train-tiny-model OUT {flags}{stop}"


def reproduce_chain(init_manifest: dict[str, Any], init_from: str) -> list[str]:
    """The commands, in order, that wrote the `init_from` folder of `init_manifest` from random weights: its own
    chain (or its `reproduce`), the last of them writing to `init_from` instead of OUT."""
    chain = list(init_manifest.get("reproduce_chain") or [init_manifest["reproduce"]])
    head, sep, tail = chain[-1].partition(" train-tiny-model OUT ")
    if not sep:
        raise ValueError(f"expected a 'train-tiny-model OUT ...' command, got {chain[-1]!r}")
    return chain[:-1] + [f"{head} train-tiny-model {shlex.quote(init_from)} {tail}"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field (--field-name; bools as --x/--no-x), typed, with the field's help and
    default. Unset flags stay out of the namespace, so the dataclass' defaults apply (`config_from_args`)."""
    group = parser.add_argument_group("training recipe (TrainConfig; the defaults: the staged from-scratch recipe)")
    default = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(default, f.name)
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        parse = value_parser(TrainConfig, f.name)
        if parse in (parse_mix, parse_pair):
            kwargs["metavar"] = "TASK=SHARE,..." if parse is parse_mix else "LOW,HIGH"
        if parse is None:
            kwargs.update(action=argparse.BooleanOptionalAction, help=f"{f.metadata['help']} (default: {value})")
        else:
            shown = "none" if value is None else format_value(value) or "''"
            kwargs.update(type=parse, help=f"{f.metadata['help']} (default: {shown})")
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` of the parsed flags (fields without a flag keep their defaults)."""
    return TrainConfig(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if hasattr(args, f.name)}
    )


def _run_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    manifest = run(args.out, cfg, device, args.data_workers, args.threads, args.checkpoint_every, args.workers)
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
    """Register `train-tiny-model OUT [recipe flags] [--device D --threads N --workers N --data-workers N
    --checkpoint-every N]`."""
    p = subparsers.add_parser("train-tiny-model", help="train the tiny NemotronH on the synthetic tasks")
    p.add_argument("out", metavar="OUT", help="output checkpoint folder (created if missing)")
    add_train_arguments(p)
    machine = p.add_argument_group("machine (the batches and the schedule do not depend on these)")
    machine.add_argument("--device", default="auto", help="torch device: auto (cuda if available), cpu, cuda")
    machine.add_argument("--data-workers", type=int, default=1, help="processes that build batches ahead (default: 1)")
    machine.add_argument("--threads", type=int, default=2, help="torch intra-op threads per worker (default: 2)")
    machine.add_argument(
        "--workers",
        type=int,
        default=1,
        help="data-parallel training processes, each on its share of every step's rows (default: 1)",
    )
    machine.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="write the weights so far to OUT/checkpoint every N steps (0: never)",
    )
    p.set_defaults(func=_run_cli)


if __name__ == "__main__":
    sys.exit(main())
