"""The start-up warm-up (service/engine/warmup.py): it runs the traffic it claims, and leaves nothing behind."""

from __future__ import annotations

import torch

from service.engine import SamplingParams
from service.engine.config import CUDA_WARMUP_STEPS, EngineConfig
from service.engine.kernels.compile_watch import CompileWatch
from service.engine.warmup import warm_up
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.marks import gpu, needs_cuda

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


@gpu
@needs_cuda
def test_after_the_default_warm_up_other_step_shapes_load_no_kernel_variant(mixed_ckpt):
    """Served traffic makes step shapes the random warm-up did not (batch sizes and page-table widths equal to 1, a
    multiple of 16 or neither, long contexts beside few requests): none may compile a kernel inside a user's step."""
    cfg = dict(CACHED, max_num_seqs=48, max_num_batched_tokens=512, device="cuda", kernel_backend="triton")
    engine = make_engine(mixed_ckpt, warmup_steps=CUDA_WARMUP_STEPS, **cfg)
    watch = CompileWatch()
    try:
        for batch, prompt_len in ((1, 5), (1, 257), (16, 256), (17, 16), (33, 40), (2, 511)):
            prompts = [random_ids(prompt_len, seed) for seed in range(batch)]
            engine.generate(prompts, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
        engine.generate([random_ids(30, 1)], SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, seed=3))
        torch.cuda.synchronize()
        assert watch.num_compiles == 0, f"kernels compiled after the warm-up: {watch.take()}"
    finally:
        watch.close()
