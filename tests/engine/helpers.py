"""Test helpers that drive the engine's real data path."""

from __future__ import annotations

import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.distributed.step import StepPlan, StepRow
from service.engine.runner.batch import build_forward_batch


def make_engine(path: str, **kw) -> Engine:
    base = dict(
        model_path=path,
        device="cpu",
        mamba_cache_strategy="off",
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        debug_integrity=True,
    )
    base.update(kw)
    return Engine(EngineConfig(**base))


def full_prefill_logits(engine: Engine, ids: list[int], rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at every prompt position (or at the positions `rows`) from one cold prefill through the engine's batch
    builder and pools."""
    pools, state = engine.cache.pools, engine.runner.pools
    page_ids = pools.pages.alloc(-(-len(ids) // engine.config.page_size))
    slot = pools.live.alloc()
    try:
        plan = StepPlan(
            (StepRow("probe", 0, len(ids), slot, tuple(page_ids), tuple(ids), (), SamplingParams(max_tokens=1)),)
        )
        state.zero_slots([slot])
        batch = build_forward_batch(plan, engine.config.page_size, engine.model_config.chunk_size, engine.runner.device)
        logits = engine.runner.model(
            batch.input_ids,
            batch.attn,
            batch.mamba,
            torch.arange(len(ids)) if rows is None else rows,
            state.kv,
            state.conv,
            state.ssm,
        )
    finally:
        pools.pages.decref(page_ids)
        pools.live.free(slot)
    return logits


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def random_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()
