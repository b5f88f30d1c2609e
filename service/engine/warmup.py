"""Start-up warm-up: random traffic through a new engine before its first request (`EngineConfig.warmup_steps`).

Triton compiles a kernel once per specialization (an integer argument equal to 1, a multiple of 16 or neither;
the launcher's tile choice for the size) and each process loads every compiled variant on its first use. A
served engine meets step shapes that a benchmark's closed loop never makes: prompt chunks beside any number of
decode rows, as arrivals trickle in. Without a warm-up those compiles and loads land in users' steps (a fresh
server's first workload ran its steps at 2-3x their warm time). The warm-up sweeps the running batch from one
request up to `max_num_seqs` and back down, admitting prompts of log-uniform lengths (some sharing a prefix, so
cache hits and snapshot copies run too) with greedy, sampled and logprob requests, then aborts what is left.
The engine resets its scheduling state afterwards (`Engine._reset`), so nothing of the warm-up stays behind."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from service.engine.request import SamplingParams

if TYPE_CHECKING:
    from service.engine.engine import Engine

NUM_SHARED_PREFIXES = 4  # a third of the prompts start with one of these
MAX_NEW_TOKENS = 64  # a warm-up request's max_tokens is drawn from [1, this]
MAX_ARRIVALS_PER_STEP = 32  # requests added before one step at most


def warm_up(engine: Engine, num_steps: int, seed: int = 0) -> None:
    """Runs `num_steps` steps of random traffic, then aborts the requests still running. The engine must be idle."""
    if engine.has_unfinished():
        raise RuntimeError("the warm-up needs an engine without requests")
    rng = random.Random(seed)
    cfg = engine.config
    vocab = engine.model_config.vocab_size
    capacity = engine.cache.pools.pages.num_usable * cfg.page_size  # tokens the KV pool holds
    max_prompt = max(2, min(2 * cfg.max_num_batched_tokens, engine.max_model_len // 2, capacity // 8))
    prefixes = [_tokens(rng, vocab, _length(rng, max_prompt // 2)) for _ in range(NUM_SHARED_PREFIXES)]
    for step in range(num_steps):
        target = round(cfg.max_num_seqs * math.sin(math.pi * (step + 0.5) / num_steps))  # requests to hold
        arrivals = min(max(0, target - len(engine.requests)), rng.randint(1, MAX_ARRIVALS_PER_STEP))
        for _ in range(arrivals):
            prompt = _tokens(rng, vocab, _length(rng, max_prompt))
            if rng.random() < 1 / 3:
                prompt = (rng.choice(prefixes) + prompt)[:max_prompt]
            engine.add_request(prompt, _params(rng))
        engine.step()
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def _length(rng: random.Random, longest: int) -> int:
    """A log-uniform length in [1, longest]."""
    return min(longest, int(math.exp(rng.uniform(0.0, math.log(longest + 1)))))


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(max(1, n))]


def _params(rng: random.Random) -> SamplingParams:
    """Greedy, sampled (top-p, top-k) or with logprobs, as served traffic mixes them."""
    max_tokens, kind = rng.randint(1, MAX_NEW_TOKENS), rng.random()
    if kind < 0.6:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if kind < 0.9:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.7, logprobs=True, top_logprobs=2, ignore_eos=True)
