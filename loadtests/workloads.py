"""Workload generators: shared-prefix groups and multi-turn sessions (pure data, no I/O).

A shared-prefix workload models many users behind one long system prompt per tenant: requests of a
group share a long prefix and differ in a short suffix. `order="interleaved"` visits the groups
round-robin (the hard case for an LRU cache on a prefix-blind router); "grouped" sends each group's
requests back to back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Order = Literal["interleaved", "grouped"]

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda river mountain cache state layer "
    "engine request server table file value result weather robot garden window number answer city "
    "model token expert question house dog cat blue green red quickly slowly under over"
).split()


@dataclass(frozen=True)
class PrefixRequest:
    """One request of a shared-prefix workload."""

    group: int  # prefix group (tenant) index
    index_in_group: int  # position of the request within its group
    prompt_token_ids: list[int]  # prefix + suffix token ids (token-level workloads)
    messages: list[dict[str, str]]  # chat messages (text-level workloads): system = prefix, user = suffix


def _order(num_groups: int, per_group: int, order: Order) -> list[tuple[int, int]]:
    if order == "interleaved":
        return [(g, i) for i in range(per_group) for g in range(num_groups)]
    if order == "grouped":
        return [(g, i) for g in range(num_groups) for i in range(per_group)]
    raise ValueError(f"order must be 'interleaved' or 'grouped', got {order!r}")


def shared_prefix_workload(
    num_groups: int,
    per_group: int,
    prefix_tokens: int,
    suffix_tokens: int,
    token_id_range: tuple[int, int],
    prefix_words: int = 200,
    suffix_words: int = 12,
    order: Order = "interleaved",
    seed: int = 0,
) -> list[PrefixRequest]:
    """`num_groups x per_group` requests. Token prompts: `prefix_tokens` ids shared per group (drawn from
    `token_id_range` = [lo, hi)) + `suffix_tokens` unique ids. Chat messages: a `prefix_words` system
    prompt per group + a unique `suffix_words` user question."""
    if num_groups < 1 or per_group < 1 or prefix_tokens < 0 or suffix_tokens < 0:
        raise ValueError("num_groups and per_group must be >= 1, token counts >= 0")
    lo, hi = token_id_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_id_range must be [lo, hi) with 0 <= lo < hi, got {token_id_range}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(lo, hi) for _ in range(prefix_tokens)] for _ in range(num_groups)]
    systems = [f"Tenant {g}. " + " ".join(rng.choice(_WORDS) for _ in range(prefix_words)) for g in range(num_groups)]
    out = []
    for g, i in _order(num_groups, per_group, order):
        suffix = [rng.randrange(lo, hi) for _ in range(suffix_tokens)]
        question = f"Question {i}: " + " ".join(rng.choice(_WORDS) for _ in range(suffix_words))
        out.append(
            PrefixRequest(
                g,
                i,
                prefixes[g] + suffix,
                [{"role": "system", "content": systems[g]}, {"role": "user", "content": question}],
            )
        )
    return out


@dataclass(frozen=True)
class Session:
    """A multi-turn conversation: the user turns, sent one after another with the model's answers in between."""

    session_id: int
    system: str  # system prompt
    user_turns: tuple[str, ...]  # user messages in order


def multi_turn_sessions(
    num_sessions: int, turns: int, system_words: int = 100, turn_words: int = 20, seed: int = 0
) -> list[Session]:
    if num_sessions < 1 or turns < 1:
        raise ValueError("num_sessions and turns must be >= 1")
    rng = random.Random(seed)
    return [
        Session(
            s,
            f"Session {s}. " + " ".join(rng.choice(_WORDS) for _ in range(system_words)),
            tuple(f"Turn {t}: " + " ".join(rng.choice(_WORDS) for _ in range(turn_words)) for t in range(turns)),
        )
        for s in range(num_sessions)
    ]


def random_token_prompts(
    num_prompts: int, prompt_tokens: int, token_id_range: tuple[int, int], seed: int = 0
) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_tokens` ids drawn uniformly from `token_id_range` = [lo, hi)."""
    if num_prompts < 1 or prompt_tokens < 1:
        raise ValueError(f"num_prompts and prompt_tokens must be >= 1, got {num_prompts}, {prompt_tokens}")
    lo, hi = token_id_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_id_range must be [lo, hi) with 0 <= lo < hi, got {token_id_range}")
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(prompt_tokens)] for _ in range(num_prompts)]
