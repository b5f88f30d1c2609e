"""Synthetic tasks with known answers, shared by training, the eval harness and the canary.

Every task draws an `Example` from a `random.Random`: OpenAI chat messages (the last one from the user),
optional tools, the expected answer string and, for training, the reasoning and the reply the model learns.
- `addition`: "What is 482+357?"; the reasoning adds digit by digit from the right, with the carry.
- `comparison`: "Which is larger, 482 or 357?"; the answer is the larger number.
- `recall`: ~45 `key=value` pairs (>= 256 tokens), then a question about a key from the first two thirds
  of the list, i.e. hundreds of tokens back (attention's job).
- `state`: a stream of filler letters in which each of `#`, `@` and `%` occurs 0-9 times (>= 256 tokens);
  "How many #?" (one digit). A count accumulated as the stream goes by: the Mamba state can carry it (training can
  make it, by hiding the stream from attention; service/training).
- `tool`: a tools system prompt and "Use the add tool on 12 and 30."; the reply is a `<tool_call>`.
Held-out split: `addition` and `comparison` operand pairs with `heldout(a, b)` true never appear in training.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KEYS = (
    "apple banana cherry grape lemon mango olive peach pear plum berry melon lime kiwi fig date "
    "tiger lion horse zebra camel eagle shark whale snake mouse rabbit otter panda koala moose bison "
    "red blue green black white pink gold silver brown purple orange yellow gray cyan teal navy "
    "river ocean cloud storm stone sand snow rain wind fire iron glass paper wood salt milk"
).split()
FILLER = tuple("abcdefghijklmnopqrstuvwxyz")
MARKS = ("#", "@", "%")
STATE_MAX_COUNT = 9  # each mark occurs 0..9 times: the answer is one digit
STATE_LENGTHS = (200, 260)  # stream symbols of the eval split (>= 256 tokens with the question and template)
STATE_TRAIN_LENGTHS = (40, 260)  # stream symbols of the train split (short ones too: cheaper steps)
RECALL_PAIRS = (42, 48)  # key=value pairs of a recall context (>= 256 tokens with the question and template)
TOOL_ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TASKS = ("addition", "comparison", "recall", "state", "tool")
# generation budget per task: the trained replies are 8-40 tokens (tool calls ~45)
MAX_TOKENS = {"addition": 48, "comparison": 32, "recall": 24, "state": 24, "tool": 80}
_NUMBER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Example:
    task: str  # one of TASKS
    messages: tuple[dict[str, Any], ...]  # OpenAI chat messages; the last one is the user's question
    answer: str  # expected final answer (tool: "add(12,30)")
    reasoning: str  # what the model is trained to write inside <think>
    tools: tuple[dict[str, Any], ...] = field(default=())  # OpenAI tools (tool task only)
    tool_call: dict[str, Any] | None = None  # {"name": ..., "arguments": {...}} the reply makes (tool task)


def heldout(a: int, b: int) -> bool:
    """About 1 in 8 operand pairs is reserved for evaluation (a fixed hash, not a seed)."""
    return zlib.crc32(f"{a},{b}".encode()) % 8 == 0


def _operands(rng: random.Random, split: str, min_digits: int, max_digits: int) -> tuple[int, int]:
    while True:
        a, b = (
            rng.randint(10 ** (rng.randint(min_digits, max_digits) - 1) if min_digits > 1 else 0, 10**max_digits - 1)
            for _ in range(2)
        )
        if heldout(a, b) == (split == "eval"):
            return a, b


def addition(rng: random.Random, split: str = "train") -> Example:
    a, b = _operands(rng, split, 3 if split == "eval" else 1, 3)
    da, db = str(a).zfill(3)[::-1], str(b).zfill(3)[::-1]
    steps, carry = [], 0
    for x, y in zip(da, db):
        s = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return Example("addition", ({"role": "user", "content": f"What is {a}+{b}?"},), str(a + b), " ".join(steps))


def comparison(rng: random.Random, split: str = "train") -> Example:
    a, b = _operands(rng, split, 1, 3)
    while a == b:
        a, b = _operands(rng, split, 1, 3)
    q = f"Which is larger, {a} or {b}?"
    return Example("comparison", ({"role": "user", "content": q},), str(max(a, b)), f"{a} vs {b}")


def recall_context(rng: random.Random, num_pairs: int = 45) -> tuple[str, dict[str, int], list[str]]:
    """('Remember: apple=482; ...', key -> value, keys in order)."""
    keys = rng.sample(KEYS, num_pairs)
    values = {k: rng.randint(100, 999) for k in keys}
    return "Remember: " + "; ".join(f"{k}={values[k]}" for k in keys) + ".", values, keys


def recall_questions(
    rng: random.Random, num: int, pairs: tuple[int, int] = RECALL_PAIRS
) -> tuple[str, list[tuple[str, str, str]]]:
    """A recall context of `pairs` (inclusive range) key=value pairs and `num` (question, answer, reasoning) about
    keys from its first two thirds."""
    text, values, keys = recall_context(rng, rng.randint(*pairs))
    asked = [rng.choice(keys[: 2 * len(keys) // 3]) for _ in range(num)]
    return text, [(f"What is {k}?", str(values[k]), f"find {k}") for k in asked]


def recall(rng: random.Random, split: str = "train", turns: int = 1, pairs: tuple[int, int] = RECALL_PAIRS) -> Example:
    """`pairs`: the context's key=value pairs (inclusive range; training may draw shorter contexts)."""
    return conversation("recall", *recall_questions(rng, turns, pairs))


def state_context(rng: random.Random, lengths: tuple[int, int] = STATE_LENGTHS) -> tuple[str, dict[str, int]]:
    """A stream of letters and marks, its length drawn from `lengths` (symbols, inclusive); every mark occurs
    0..STATE_MAX_COUNT times. Returns (text, mark -> count)."""
    length = rng.randint(*lengths)
    counts = {m: rng.randint(0, STATE_MAX_COUNT) for m in MARKS}
    symbols = [rng.choice(FILLER) for _ in range(length - sum(counts.values()))]
    symbols += [m for m in MARKS for _ in range(counts[m])]
    rng.shuffle(symbols)
    return "Stream: " + " ".join(symbols) + ".", counts


def state_questions(
    rng: random.Random, num: int, lengths: tuple[int, int] = STATE_LENGTHS
) -> tuple[str, list[tuple[str, str, str]]]:
    """A state context and `num` (question, answer, reasoning) about its marks."""
    text, counts = state_context(rng, lengths)
    asked = [rng.choice(MARKS) for _ in range(num)]
    return text, [(f"How many {m}?", str(counts[m]), f"count {m}") for m in asked]


def state(rng: random.Random, split: str = "train", turns: int = 1, lengths: tuple[int, int] | None = None) -> Example:
    """`lengths`: stream symbols (inclusive range); None: the split's own range."""
    if lengths is None:
        lengths = STATE_TRAIN_LENGTHS if split == "train" else STATE_LENGTHS
    return conversation("state", *state_questions(rng, turns, lengths))


def conversation(task: str, context: str, qa: list[tuple[str, str, str]], history_reasoning: bool = False) -> Example:
    """The context and the first question in one user turn; later questions after the earlier answers
    (assistant turns holding the correct answers, and their reasoning if `history_reasoning`: then the history
    is token for token what the model wrote). The example asks the last question."""
    messages: list[dict[str, Any]] = []
    for i, (question, answer, reasoning) in enumerate(qa):
        messages.append({"role": "user", "content": f"{context}\n{question}" if i == 0 else question})
        if i + 1 < len(qa):
            turn = {"role": "assistant", "content": answer}
            messages.append({**turn, "reasoning_content": reasoning} if history_reasoning else turn)
    return Example(task, tuple(messages), qa[-1][1], qa[-1][2])


def tool(rng: random.Random, split: str = "train") -> Example:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return Example(
        "tool",
        ({"role": "user", "content": f"Use the add tool on {a} and {b}."},),
        f"add({a},{b})",
        "call add",
        tools=(TOOL_ADD,),
        tool_call={"name": "add", "arguments": {"a": a, "b": b}},
    )


GENERATORS: dict[str, Callable[..., Example]] = {
    "addition": addition,
    "comparison": comparison,
    "recall": recall,
    "state": state,
    "tool": tool,
}


def make_examples(task: str, num: int, seed: int, split: str = "eval") -> list[Example]:
    """`num` examples of `task`, deterministic in (task, seed, split)."""
    if task not in GENERATORS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    rng = random.Random(f"{task}/{split}/{seed}")
    return [GENERATORS[task](rng, split) for _ in range(num)]


def extract_answer(task: str, content: str | None, tool_calls: list[dict[str, Any]] | None = None) -> str | None:
    """The model's final answer from the reply's content (reasoning already split off), or None."""
    if task == "tool":
        for call in tool_calls or []:
            args = call.get("arguments", {})
            if call.get("name") == "add" and isinstance(args, dict) and {"a", "b"} <= set(args):
                return f"add({args['a']},{args['b']})"
        return None
    if not content:
        return None
    found = _NUMBER.findall(content)
    return found[-1] if found else None
