"""The start-up warm-up (service/engine/warmup.py): it runs the traffic it claims, and leaves nothing behind."""

from __future__ import annotations

from service.engine import SamplingParams
from service.engine.config import CUDA_WARMUP_STEPS, EngineConfig
from service.engine.warmup import warm_up
from tests.engine.helpers import greedy, make_engine, random_ids

CACHED = dict(mamba_cache_strategy="extra_buffer", page_size=16, max_num_seqs=8, max_num_batched_tokens=96)


def _workload(engine) -> tuple[list, dict]:
    """Greedy and seeded outputs of prompts with a shared prefix (the second one hits the cache), then stats."""
    shared = random_ids(64, 3)
    prompts = [shared + random_ids(9, 4), random_ids(30, 5), shared + random_ids(21, 6)]
    outs = [engine.generate([p], greedy(12))[0].token_ids for p in prompts]
    sampled = engine.generate([random_ids(17, 7)], SamplingParams(max_tokens=8, temperature=1.0, seed=11))
    outs.append(sampled[0].token_ids)
    return outs, engine.stats()


def test_warm_up_runs_mixed_traffic_with_cache_hits(mixed_ckpt):
    engine = make_engine(mixed_ckpt, **CACHED)
    warm_up(engine, 60)
    assert engine.num_steps >= 60
    assert engine.num_generation_tokens > 60  # requests decoded, several per step
    assert engine.cache.counters.hit_tokens > 0  # shared prefixes resumed from snapshots
    assert not engine.requests and not engine.has_unfinished()
    engine.check_integrity()


def test_engine_after_warm_up_equals_a_fresh_engine(mixed_ckpt):
    fresh = make_engine(mixed_ckpt, **CACHED)
    warmed = make_engine(mixed_ckpt, warmup_steps=60, **CACHED)
    assert warmed.num_steps == 0 and warmed.stats() == fresh.stats()  # counters, pools and cache as new
    assert warmed.cached_prefix_hashes() == []
    outs_fresh, stats_fresh = _workload(fresh)
    outs_warmed, stats_warmed = _workload(warmed)
    assert outs_warmed == outs_fresh
    assert stats_warmed == stats_fresh
    assert stats_warmed["prefix_cache_hit_tokens"] > 0


def test_warm_up_default_is_cuda_only(mixed_ckpt):
    assert EngineConfig(model_path=mixed_ckpt, device="cpu").resolved().warmup_steps == 0
    assert EngineConfig(model_path=mixed_ckpt, device="cuda").resolved().warmup_steps == CUDA_WARMUP_STEPS
    assert EngineConfig(model_path=mixed_ckpt, device="cuda", warmup_steps=3).resolved().warmup_steps == 3
