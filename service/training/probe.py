"""Whether a checkpoint keeps the state task's count in its recurrent state: teacher-forced greedy accuracy on
held-out state questions (transformers' NemotronH), as is (`normal`) and with the attention layers' queries after
the stream blind to all of its keys (`attention_blind`: the count can then only arrive through the Mamba layers'
state). A model that counts with attention loses `attention_blind`; one that counts in the state keeps it.
"""

from __future__ import annotations

import os

import torch

from service.engine.tokenizer import Tokenizer
from service.evals.tasks import make_examples
from service.testing.tiny import tokenizer_config
from service.training.data import attention_mask_hiding, make_batch


def load(path: str) -> tuple[object, Tokenizer]:
    """A checkpoint folder's transformers model (fp32, eval mode) and our tokenizer over its tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import NemotronHForCausalLM

    hf = HFTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    model = NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, Tokenizer(hf, tokenizer_config(hf))


@torch.no_grad()
def state_accuracy_ablations(
    model: object, tokenizer: Tokenizer, num: int, device: str = "cpu", seed: int = 0, batch_size: int = 50
) -> dict[str, float]:
    """Teacher-forced accuracy (every reply token is the argmax) on `num` held-out state questions, per ablation."""
    examples = make_examples("state", num, seed)
    pad_id = tokenizer.token_to_id("<|pad|>")
    correct = {"normal": 0, "attention_blind": 0}
    for i in range(0, num, batch_size):
        batch = make_batch(tokenizer, examples[i : i + batch_size], pad_id, (0.0,) * len(examples[i : i + batch_size]))
        masks = {
            "normal": None,
            "attention_blind": {"full_attention": attention_mask_hiding(batch).to(device), "linear_attention": None},
        }
        reply = batch.labels != -100
        for name, mask in masks.items():
            pred = model(input_ids=batch.input_ids.to(device), attention_mask=mask).logits.argmax(-1).cpu()
            correct[name] += int(((pred == batch.labels) | ~reply).all(dim=1).sum())
    return {name: n / num for name, n in correct.items()}
