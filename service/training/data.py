"""Tokenizer and training sequences for the trained tiny model.

The tokenizer is byte-level BPE like the random tiny model's, with two changes for arithmetic: digits are
always single tokens (`Digits(individual_digits=True)` before the byte-level split), and the merges are learned
on the task corpus, so every recall key and filler letter is one token. Special tokens, the chat template and
`tokenizer_config.json` are the tiny model's.

A training sequence is the chat template's rendering of an example's conversation plus the assistant reply the
model learns (`<think>\\n{reasoning}\\n</think>\\n{answer}<|im_end|>`, or a `<tool_call>` block); the loss covers
the reply only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from service.engine.tokenizer import Tokenizer, compile_chat_template
from service.evals.tasks import GENERATORS, Example
from service.testing.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

TOKENIZER_VOCAB_SIZE = 768
_CORPUS_SEED = 4321


def reply_text(example: Example) -> str:
    """What the assistant writes after the generation prompt (which ends in `<think>\\n`)."""
    if example.tool_call is not None:
        args = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in example.tool_call["arguments"].items())
        body = f"<tool_call>\n<function={example.tool_call['name']}>\n{args}</function>\n</tool_call>\n"
    else:
        body = example.answer
    return f"{example.reasoning}\n</think>\n{body}<|im_end|>"


def prompt_text(tokenizer: Tokenizer, example: Example) -> str:
    return tokenizer.apply_chat_template(
        list(example.messages), tools=list(example.tools) or None, add_generation_prompt=True
    )


def train_tokenizer() -> HFTokenizer:
    """Byte-level BPE over task conversations rendered with the chat template, replies included."""
    rng = random.Random(_CORPUS_SEED)
    template = compile_chat_template(CHAT_TEMPLATE)
    corpus = []
    for _ in range(300):
        for make in GENERATORS.values():
            ex = make(rng)
            corpus.append(
                template.render(messages=list(ex.messages), tools=list(ex.tools) or None, add_generation_prompt=True)
                + reply_text(ex)
            )
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(c, special=s, normalized=False) for c, s in SPECIAL_TOKENS],
    )
    tk.train_from_iterator(corpus, trainer)
    tk.add_special_tokens([AddedToken(c, special=True, normalized=False) for c, s in SPECIAL_TOKENS if s])
    tk.add_tokens([AddedToken(c, special=False, normalized=False) for c, s in SPECIAL_TOKENS if not s])
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tk.token_to_id("<s>"))]
    )
    return tk


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with pad_id
    labels: torch.Tensor  # [B, T] int64, the next token at each position; -100 outside replies and padding
    # per row, the token range [start, end) of the state task's stream that attention after it must not see
    # (a training-time mask: the count then has to come through the Mamba layers); None: attention sees everything
    hidden_spans: tuple[tuple[int, int], ...] | None = None


def stream_span(tokenizer: Tokenizer, example: Example) -> tuple[int, int]:
    """Token range [start, end) of the `Stream: ... .` text in the state example's prompt (first user turn)."""
    text = prompt_text(tokenizer, example)
    start = text.index("Stream: ")
    end = text.index(".\n", start) + 1
    # the cuts fall on pre-token boundaries (a newline before, a newline after), so prefixes encode as prefixes
    return len(tokenizer.encode(text[:start])), len(tokenizer.encode(text[:end]))


def attention_mask_hiding(batch: Batch) -> torch.Tensor:
    """[B, 1, T, T] additive float mask: causal, and queries after a hidden span see none of its keys."""
    width = batch.input_ids.shape[1]
    mask = torch.full((len(batch.input_ids), 1, width, width), float("-inf")).triu(1)
    for row, (start, end) in enumerate(batch.hidden_spans or ()):
        mask[row, 0, end:, start:end] = float("-inf")
    return mask


def encode(tokenizer: Tokenizer, example: Example) -> tuple[list[int], int]:
    """(token ids of prompt + reply, number of prompt tokens)."""
    prompt = tokenizer.encode(prompt_text(tokenizer, example))
    return prompt + tokenizer.encode(reply_text(example)), len(prompt)


def make_batch(
    tokenizer: Tokenizer, examples: list[Example], pad_id: int, visible_fractions: tuple[float, ...] | None = None
) -> Batch:
    """Right-padded rows. `visible_fractions` (state examples only, one per row): hide each row's stream from
    attention except its first fraction (0.0: the whole stream is hidden)."""
    rows = [encode(tokenizer, ex) for ex in examples]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    labels = torch.full((len(rows), width), -100, dtype=torch.int64)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        # position t predicts token t+1; the reply's tokens are ids[n_prompt:]
        labels[i, n_prompt - 1 : len(ids) - 1] = torch.tensor(ids[n_prompt:])
    spans = None
    if visible_fractions is not None:
        spans = tuple(
            (start + int(f * (end - start)), end)
            for (start, end), f in zip((stream_span(tokenizer, ex) for ex in examples), visible_fractions)
        )
    return Batch(input_ids, labels, spans)
