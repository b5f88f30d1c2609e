"""The accuracy canary passes on a correct cache and catches the SGLang offset bug when it is re-injected."""

from __future__ import annotations

import asyncio

import pytest

import service.engine.runner.batch as batch_mod
from service.engine import AsyncEngine, EngineConfig
from service.engine.canary import audit_hit, pinned_canary, pinned_prompts
from tests.engine.cache_helpers import buggy_snapshot_chunk_indices
from tests.engine.helpers import greedy, random_ids


def _with_engine(path, fn):
    async def main():
        engine = AsyncEngine(
            EngineConfig(model_path=path, device="cpu", page_size=4, mamba_cache_strategy="extra_buffer")
        )
        try:
            return await fn(engine)
        finally:
            await engine.shutdown(drain_timeout_s=1)

    return asyncio.run(main())


def test_pinned_canary_passes_on_correct_cache(mixed_ckpt):
    async def run(engine):
        prompts = pinned_prompts(engine.engine.model_config.vocab_size, engine.stats()["snapshot_grid_tokens"])
        return [await pinned_canary(engine, p) for p in prompts]

    for check in _with_engine(mixed_ckpt, run):
        assert not check.mismatch, check
        assert check.num_cached_tokens > 0 and check.max_state_rel_error <= 1e-5 and check.token_agreement == 1.0


def test_pinned_canary_catches_cumsum_offset_bug(mixed_ckpt, monkeypatch):
    monkeypatch.setattr(batch_mod, "snapshot_chunk_indices", buggy_snapshot_chunk_indices)

    async def run(engine):
        prompts = pinned_prompts(engine.engine.model_config.vocab_size, engine.stats()["snapshot_grid_tokens"])
        return [await pinned_canary(engine, p) for p in prompts]

    checks = _with_engine(mixed_ckpt, run)
    assert any(c.mismatch and c.max_state_rel_error > 1e-3 for c in checks), checks


def test_audit_of_a_real_hit(mixed_ckpt):
    async def run(engine):
        prefix = random_ids(40, 5)
        async for _ in engine.generate(prefix + random_ids(5, 6), greedy(2)):
            pass
        rid = "audited"
        async for out in engine.generate(prefix + random_ids(7, 7), greedy(2), request_id=rid, capture_states=True):
            pass
        captured = (await engine.pop_captured_states(rid))["hit"]
        assert captured.num_tokens == out.num_cached_tokens > 0
        return await audit_hit(engine, out.prompt_token_ids, captured)

    check = _with_engine(mixed_ckpt, run)
    assert not check.mismatch and check.max_state_rel_error <= 1e-5


def test_bypass_cache_neither_reads_nor_writes(mixed_ckpt):
    from tests.engine.helpers import make_engine

    engine = make_engine(mixed_ckpt, mamba_cache_strategy="extra_buffer")
    prompt = random_ids(50, 8)
    engine.add_request(prompt, greedy(2), bypass_cache=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.cache.tree.snapshot_prefix_lengths() == []
    engine.generate([prompt], greedy(2))
    rid = engine.add_request(prompt, greedy(2), bypass_cache=True)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o for o in outs if o.request_id == rid][-1].num_cached_tokens == 0
    assert engine.stats()["prefix_cache_queried_tokens"] == len(prompt)


@pytest.mark.parametrize("n", [70])
def test_captured_states_are_bounded(mixed_ckpt, n):
    from service.engine.engine import MAX_CAPTURED_REQUESTS
    from tests.engine.helpers import make_engine

    engine = make_engine(mixed_ckpt, mamba_cache_strategy="off", max_num_seqs=8)
    for i in range(n):
        engine.add_request(random_ids(5, 100 + i), greedy(1), capture_states=True)
    while engine.has_unfinished():
        engine.step()
    assert len(engine.captured) == MAX_CAPTURED_REQUESTS
