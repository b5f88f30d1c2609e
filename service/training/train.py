"""`hybrid-serve train-tiny-model OUT`: train the embedded tiny NemotronH on the synthetic tasks.

The model is transformers' `NemotronHForCausalLM` (its pure-torch Mamba-2 path is differentiable; our engine
loads what it saves). One step = one batch of a single task (drawn by `TrainConfig.mix`), right-padded, loss on
the assistant replies only; AdamW with warm-up and cosine decay. Reproducible: torch's generator seeds the
initial weights and step i's batch comes from `random.Random(f"{seed}/{i}")` alone (whatever the number of data
workers). Greedy accuracy is measured teacher-forced: a reply counts as correct when the argmax at every reply
position is the reply's next token, which is exactly when greedy decoding would write that reply.
"""

from __future__ import annotations

import math
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import GENERATORS, Example, make_examples
from service.testing.tiny import tiny_config
from service.training.config import TrainConfig
from service.training.data import Batch, attention_mask_hiding, make_batch
from service.training.parallel import Shard, shard_rows

# Every layer kind (Mamba-2, attention, latent MoE); ~0.8M parameters, ~3 MB in fp32.
MODEL_OVERRIDES: dict[str, Any] = dict(
    hidden_size=128,
    hybrid_override_pattern="ME*ME*ME",
    mamba_num_heads=8,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    chunk_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    moe_latent_size=64,
    moe_shared_expert_intermediate_size=128,
    initializer_range=0.02,
    time_step_limit=[0.0, 1e9],
    time_step_min=0.001,
    time_step_max=0.1,
    max_position_embeddings=4096,
)
EVAL_TASKS = ("addition", "comparison", "recall", "state", "tool")


def build_model(tokenizer: Tokenizer, seed: int) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    hf_cfg = tiny_config(_SizesView(tokenizer), **MODEL_OVERRIDES)
    hf_cfg = {k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    return NemotronHForCausalLM(NemotronHConfig(**hf_cfg))


class _SizesView:
    """`tiny_config` asks a `tokenizers.Tokenizer` for its size and special ids; this answers from ours."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tk = tokenizer

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._tk.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def step_examples(cfg: TrainConfig, step: int) -> tuple[str, list[Example]]:
    """Step `step`'s task and examples, a function of (seed, step) only."""
    return _step_plan(cfg, step)[:2]


def _step_plan(cfg: TrainConfig, step: int) -> tuple[str, list[Example], tuple[float, ...] | None]:
    """(task, examples, per-row visible fraction of the state stream or None: nothing hidden), a function of
    (seed, step) only."""
    rng = random.Random(f"{cfg.seed}/{step}")
    mix = cfg.first_mix if cfg.first_mix and step < cfg.first_mix_steps else cfg.mix
    task = rng.choices(list(mix), weights=list(mix.values()))[0]
    kw: dict[str, Any] = {}
    if task in ("recall", "state"):
        kw["turns"] = 2 if rng.random() < cfg.multi_turn_share else 1
        size_range = cfg.recall_pairs if task == "recall" else cfg.state_lengths
        kw["pairs" if task == "recall" else "lengths"] = (
            _band(cfg, step, size_range, rng) if cfg.length_bands else size_range
        )
    examples = [GENERATORS[task](rng, "train", **kw) for _ in range(cfg.batch_size)]
    if not (task == "state" and step >= cfg.state_hidden_from and rng.random() < cfg.state_hidden_share):
        return task, examples, None
    return task, examples, tuple(rng.random() if cfg.state_hidden_partial else 0.0 for _ in examples)


def _band(cfg: TrainConfig, step: int, size_range: tuple[int, int], rng: random.Random) -> tuple[int, int]:
    """The step's (low, high) row sizes: a tenth of `size_range` ending at a drawn upper size (see `length_bands`)."""
    low, high = size_range
    reach = 1.0 if step >= cfg.ramp_steps else max(0.1, (step - cfg.ramp_from) / max(1, cfg.ramp_steps - cfg.ramp_from))
    upper = rng.randint(low, low + round(reach * (high - low)))
    return max(low, upper - (high - low) // 10), upper


class _Steps(torch.utils.data.IterableDataset):
    """Batches for steps [0, steps) (this training worker's rows of each), split round-robin over data workers and
    re-ordered by the loader."""

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer, shard: Shard) -> None:
        self.cfg, self.tokenizer, self.shard = cfg, tokenizer, shard

    def __iter__(self) -> Iterator[tuple[int, str, Batch]]:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        pad_id = self.tokenizer.token_to_id("<|pad|>")
        for step in range(wid, self.cfg.steps, nw):
            task, examples, visible = _step_plan(self.cfg, step)
            rows, visible = shard_rows(examples, self.shard), shard_rows(visible, self.shard)
            yield step, task, make_batch(self.tokenizer, rows, pad_id, visible)


def _ignore_sigterm(worker_id: int) -> None:
    """Data workers outlive a SIGTERM sent to the whole process group (`timeout` does that): the training loop
    stops at the next step and still saves; the loader then ends its workers."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _masks(batch: Batch, device: str) -> dict[str, torch.Tensor | None] | None:
    """transformers' per-layer-kind masks when the batch hides spans from attention (Mamba layers: no mask)."""
    if batch.hidden_spans is None:
        return None
    return {"full_attention": attention_mask_hiding(batch).to(device), "linear_attention": None}


@dataclass(frozen=True)
class TrainResult:
    model: Any  # the trained transformers model, in eval mode
    steps_done: int  # optimizer steps taken (< cfg.steps if stopped early)
    final_loss: dict[str, float]  # task -> mean loss over its steps in the last 10% of the steps taken
    step_losses: tuple[float, ...]  # the loss of every step taken, in step order


def train(
    cfg: TrainConfig,
    tokenizer: Tokenizer,
    device: str = "cpu",
    data_workers: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[int, Any], None] = lambda steps_done, model: None,
    shard: Shard | None = None,
) -> TrainResult:
    """Train from scratch; stops early at `cfg.stop_at` steps or once `should_stop()` (checked every step, on any
    worker). Every `checkpoint_every` steps (0: never) calls `on_checkpoint(steps_done, model)` (the model in train
    mode; the callback must not change it). With a `shard` of `world` > 1 this worker trains on its rows of every step
    (service/training/parallel.py); only worker 0 logs and checkpoints."""
    shard = shard or Shard()
    if cfg.init_from is not None:
        from transformers import NemotronHForCausalLM

        model = NemotronHForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
    else:
        model = build_model(tokenizer, cfg.seed)
    model.to(device).train()
    is_decayed = {n: p.dim() >= 2 and "embeddings" not in n for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if is_decayed[n]], "weight_decay": cfg.weight_decay},
            {"params": [p for n, p in model.named_parameters() if not is_decayed[n]], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    # the loader's workers interleave in order (in-order iteration), so step i always gets batch i
    loader = torch.utils.data.DataLoader(
        _Steps(cfg, tokenizer, shard),
        batch_size=None,
        num_workers=data_workers,
        prefetch_factor=4 if data_workers else None,
        worker_init_fn=_ignore_sigterm,
    )
    losses: list[tuple[str, torch.Tensor]] = []  # (task, the step's loss over the whole batch)
    start = time.monotonic()
    steps_done = 0
    for step, task, batch in loader:
        stops, num_label_tokens = shard.sum_counts([int(should_stop()), int((batch.labels != -100).sum())])
        if stops or (cfg.stop_at is not None and step >= cfg.stop_at):
            break
        logits = model(input_ids=batch.input_ids.to(device), attention_mask=_masks(batch, device)).logits
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch.labels.to(device).flatten(), ignore_index=-100, reduction="sum"
        ) / max(1, num_label_tokens)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        loss = shard.sum_grads(model, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        losses.append((task, loss))
        if shard.rank == 0 and (step % 50 == 0 or step == cfg.steps - 1):
            log(f"step {step} {task} loss {loss.item():.4f} lr {lr_at(cfg, step):.2e} {time.monotonic() - start:.1f}s")
        if shard.rank == 0 and checkpoint_every and steps_done % checkpoint_every == 0 and steps_done < cfg.steps:
            on_checkpoint(steps_done, model)
    model.eval()
    recent: dict[str, list[float]] = {}
    for task, value in losses[int(0.9 * len(losses)) :]:
        recent.setdefault(task, []).append(float(value))
    final = {t: round(sum(v) / len(v), 5) for t, v in sorted(recent.items())}
    return TrainResult(model, steps_done, final, tuple(float(value) for _, value in losses))


@torch.no_grad()
def teacher_forced_accuracy(
    model: Any, tokenizer: Tokenizer, examples: list[Example], device: str = "cpu", batch_size: int = 50
) -> float:
    """Fraction of examples whose whole reply is the greedy continuation of their prompt."""
    pad_id = tokenizer.token_to_id("<|pad|>")
    correct = 0
    for i in range(0, len(examples), batch_size):
        batch = make_batch(tokenizer, examples[i : i + batch_size], pad_id)
        pred = model(input_ids=batch.input_ids.to(device)).logits.argmax(-1).cpu()
        mask = batch.labels != -100
        correct += int(((pred == batch.labels) | ~mask).all(dim=1).sum())
    return correct / len(examples)


def heldout_accuracy(
    model: Any, tokenizer: Tokenizer, num: int, device: str = "cpu", seed: int = 0
) -> dict[str, float]:
    """Teacher-forced greedy accuracy on `num` held-out questions of every task (eval split, `seed`)."""
    return {
        task: teacher_forced_accuracy(model, tokenizer, make_examples(task, num, seed), device) for task in EVAL_TASKS
    }
