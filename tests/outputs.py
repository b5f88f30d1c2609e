"""Comparing engine outputs in tests: the same tokens, and logprobs within a tolerance."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Expected:
    """A reference sequence from outside the engine (e.g. transformers' generate)."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # chosen-token logprob per token


def assert_same_outputs(
    actual: Any, expected: Any, logprob_tol: float, *, finish_reason: bool = False, top_logprob_ids: bool = False
) -> float:
    """Assert each actual output has the expected token ids and, when both carry logprobs, per-token logprobs
    within `logprob_tol`; optionally the same finish reason and the same top-logprob token ids.

    actual / expected: one output or equally long sequences of them (anything with `token_ids` and `logprobs`).
    Returns the largest logprob difference seen (0.0 when none was compared)."""
    pairs = list(zip(actual, expected, strict=True)) if isinstance(actual, Sequence) else [(actual, expected)]
    worst = 0.0
    for i, (a, e) in enumerate(pairs):
        assert list(a.token_ids) == list(e.token_ids), f"output {i}: tokens {a.token_ids} != {e.token_ids}"
        if finish_reason:
            assert a.finish_reason == e.finish_reason, f"output {i}: {a.finish_reason} != {e.finish_reason}"
        if a.logprobs is not None and e.logprobs is not None:
            diff = max((abs(x - y) for x, y in zip(a.logprobs, e.logprobs, strict=True)), default=0.0)
            assert diff <= logprob_tol, f"output {i}: logprob difference {diff:.3e} > {logprob_tol:.0e}"
            worst = max(worst, diff)
        else:
            assert (a.logprobs is None) == (e.logprobs is None), f"output {i}: logprobs on one side only"
        if top_logprob_ids and a.top_logprobs is not None:
            assert [sorted(d) for d in a.top_logprobs] == [sorted(d) for d in e.top_logprobs], f"output {i}"
    return worst
