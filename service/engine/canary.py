"""Accuracy canary (docs/design.md: Metrics): is the prefix cache still equal to no cache, on this replica, now?

- `pinned_canary`: a pinned prompt is run warm (packed behind a decoy request of unaligned length, the
  case that broke SGLang), then again so it resumes from a snapshot, then cold with the cache bypassed.
  Compares the resumed snapshot's mamba state with a cold prefill of the same prefix, and the greedy
  tokens and logprobs of the cached and cold runs.
- `audit_hit`: a sampled real request's hit snapshot (captured by the engine) against a cold recompute.

A pinned prompt may be a question with a known answer (the deployment pins the trained tasks' questions); the
check then carries the cached run's text, which the caller scores (`answer_accuracy` on the canary metrics).

Both run through the AsyncEngine like any request, so they see the live scheduler, pools and kernels."""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.async_engine import AsyncEngine  # or EngineProcess: the same async API
from service.engine.request import CapturedState, RequestOutput, SamplingParams


@dataclass(frozen=True)
class CanaryCheck:
    kind: str  # "pinned" | "audit"
    mismatch: bool  # state or output disagreement beyond tolerance
    max_state_rel_error: float  # over conv and ssm of every mamba layer; nan if no state was compared
    token_agreement: float  # fraction of equal greedy tokens, cached vs cold (1.0 for audits)
    max_logprob_diff: float  # max |logprob cached - logprob cold| over generated tokens (0 for audits)
    num_cached_tokens: int  # prefix length the cached run resumed from (0: no hit, nothing compared)
    detail: str = ""
    text: str = ""  # the cached run's generated text (pinned checks)


def max_rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| / max |y| in fp32 (y is the reference); the canary's and the tests' state comparison."""
    return ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item()


def state_rel_error(a: CapturedState, b: CapturedState) -> float:
    return max(max_rel_error(a.conv, b.conv), max_rel_error(a.ssm, b.ssm))


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(state relative error, logprob difference) allowed for this compute dtype."""
    return (1e-4, 1e-3) if dtype == torch.float32 else (3e-2, 0.1)


def pinned_prompts(vocab_size: int, grid_tokens: int, seed: int = 1234) -> list[list[int]]:
    """Deterministic token prompts that cross several snapshot-grid points (not multiples of the grid)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (2 * grid_tokens + 5, 3 * grid_tokens + 1)]


async def _run(engine: AsyncEngine, prompt: Sequence[int], params: SamplingParams, **opts) -> tuple[str, RequestOutput]:
    rid = "canary-" + uuid.uuid4().hex
    last = None
    async for last in engine.generate(list(prompt), params, request_id=rid, **opts):
        pass
    return rid, last


async def cold_prefix_state(engine: AsyncEngine, prefix: Sequence[int]) -> CapturedState:
    rid, _ = await _run(
        engine, prefix, SamplingParams(max_tokens=1, temperature=0.0), bypass_cache=True, capture_states=True
    )
    return (await engine.pop_captured_states(rid))["prompt"]


async def pinned_canary(
    engine: AsyncEngine,
    prompt: Sequence[int],
    max_tokens: int = 8,
    tolerances: tuple[float, float] | None = None,
    ignore_eos: bool = True,
) -> CanaryCheck:
    """`ignore_eos=False` for questions: the reply ends at EOS (cached and cold must end at the same token)."""
    state_tol, lp_tol = tolerances or default_tolerances(engine.dtype)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, logprobs=True)
    decoy = list(prompt[: len(prompt) // 2 + 3])[::-1]
    await asyncio.gather(_run(engine, decoy, greedy, bypass_cache=True), _run(engine, prompt, greedy))
    hit_rid, hit = await _run(engine, prompt, greedy, capture_states=True)
    _, cold = await _run(engine, prompt, greedy, bypass_cache=True)
    captured = (await engine.pop_captured_states(hit_rid)).get("hit")
    agreement = sum(a == b for a, b in zip(hit.token_ids, cold.token_ids)) / max(
        1, len(cold.token_ids), len(hit.token_ids)
    )
    lp_diff = max((abs(a - b) for a, b in zip(hit.logprobs or [], cold.logprobs or [])), default=0.0)
    err = math.nan
    if captured is not None:
        err = state_rel_error(captured, await cold_prefix_state(engine, prompt[: captured.num_tokens]))
    mismatch = agreement < 1.0 or lp_diff > lp_tol or (not math.isnan(err) and err > state_tol)
    return CanaryCheck(
        "pinned",
        mismatch,
        err,
        agreement,
        lp_diff,
        hit.num_cached_tokens,
        "" if captured is not None else "no snapshot hit (evicted or cache off): outputs compared only",
        text=hit.text,
    )


async def audit_hit(
    engine: AsyncEngine, prompt: Sequence[int], captured: CapturedState, tolerances: tuple[float, float] | None = None
) -> CanaryCheck:
    """Recompute the prefix of a real request's hit cold and compare the state it resumed from."""
    state_tol, _ = tolerances or default_tolerances(engine.dtype)
    err = state_rel_error(captured, await cold_prefix_state(engine, prompt[: captured.num_tokens]))
    return CanaryCheck("audit", err > state_tol, err, 1.0, 0.0, captured.num_tokens)
