"""How far a (partly) trained checkpoint is: per task, the teacher-forced greedy accuracy and the mean
cross-entropy of the final answer's digits (nats per digit; ln 10 = 2.30 is a uniform guess over the digits), on
held-out questions at the eval sizes and, for recall and state, on short contexts too (a training run learns
those first). `python -m service.training.progress CKPT [--num N]` prints one JSON object; OUT/checkpoint of
`train-tiny-model --checkpoint-every` is such a folder.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

import torch

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import GENERATORS, Example, make_examples
from service.training.data import Batch, make_batch
from service.training.probe import load
from service.training.train import EVAL_TASKS

SHORT_RECALL_PAIRS = (8, 16)  # key=value pairs of the short recall contexts
SHORT_STATE_LENGTHS = (40, 100)  # stream symbols of the short state contexts


@dataclass(frozen=True)
class Progress:
    accuracy: float  # fraction of examples whose whole reply is the argmax at every reply position
    answer_ce: float  # mean cross-entropy (nats) of the answer's digit tokens after `</think>`


def answer_positions(tokenizer: Tokenizer, batch: Batch) -> torch.Tensor:
    """[B, T] bool: label positions that predict a digit of the text after `</think>` (the answer's digits)."""
    digits = torch.tensor([tokenizer.token_to_id(str(d)) for d in range(10)])
    after_think = (batch.input_ids == tokenizer.token_to_id("</think>")).cumsum(1) > 0
    return after_think & torch.isin(batch.labels, digits)


@torch.no_grad()
def measure(model: object, tokenizer: Tokenizer, examples: list[Example], batch_size: int = 25) -> Progress:
    pad_id = tokenizer.token_to_id("<|pad|>")
    correct, losses = 0, []
    for i in range(0, len(examples), batch_size):
        batch = make_batch(tokenizer, examples[i : i + batch_size], pad_id)
        logits = model(input_ids=batch.input_ids).logits
        reply = batch.labels != -100
        correct += int(((logits.argmax(-1) == batch.labels) | ~reply).all(dim=1).sum())
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.labels.flatten(), ignore_index=-100, reduction="none"
        ).view(batch.labels.shape)
        losses.append(ce[answer_positions(tokenizer, batch)])
    return Progress(correct / len(examples), float(torch.cat(losses).mean()))


def progress(model: object, tokenizer: Tokenizer, num: int, seed: int = 0) -> dict[str, Progress]:
    """Every eval task at its eval sizes, plus `recall_short` and `state_short` (eval split, `seed`)."""
    result = {task: measure(model, tokenizer, make_examples(task, num, seed)) for task in EVAL_TASKS}
    rng = random.Random(f"progress/{seed}")
    short = {
        "recall_short": [GENERATORS["recall"](rng, "eval", pairs=SHORT_RECALL_PAIRS) for _ in range(num)],
        "state_short": [GENERATORS["state"](rng, "eval", lengths=SHORT_STATE_LENGTHS) for _ in range(num)],
    }
    return result | {name: measure(model, tokenizer, examples) for name, examples in short.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.training.progress", description=__doc__)
    parser.add_argument("checkpoint", help="checkpoint folder (OUT or OUT/checkpoint of train-tiny-model)")
    parser.add_argument("--num", type=int, default=50, help="questions per task")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.checkpoint)
    with open(f"{args.checkpoint}/manifest.json", encoding="utf-8") as f:
        steps_done = json.load(f)["steps_done"]
    report = {
        name: [round(p.accuracy, 3), round(p.answer_ce, 3)] for name, p in progress(model, tokenizer, args.num).items()
    }
    print(json.dumps({"steps_done": steps_done, "task: [accuracy, answer digit CE]": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
