"""AsyncEngine: per-request streams, abort, a consumer that stops early, bad input."""

from __future__ import annotations

import asyncio

import pytest

from service.engine import AsyncEngine, EngineConfig
from tests.engine.helpers import greedy, random_ids


@pytest.fixture()
def async_engine(mixed_ckpt):
    engine = AsyncEngine(
        EngineConfig(model_path=mixed_ckpt, device="cpu", page_size=4, mamba_cache_strategy="extra_buffer")
    )
    yield engine
    asyncio.run(engine.shutdown(drain_timeout_s=1))


async def _collect(engine, prompt, params, rid=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id=rid):
        outs.append(out)
    return outs


def test_streams_are_cumulative_and_match_sync(async_engine, mixed_ckpt):
    async def main():
        return await asyncio.gather(*[_collect(async_engine, random_ids(10 + i, i), greedy(8)) for i in range(4)])

    streams = asyncio.run(main())
    sync = async_engine.engine  # same weights; compare with a fresh synchronous run on the same engine
    for i, outs in enumerate(streams):
        lengths = [len(o.token_ids) for o in outs]  # a reader that falls behind gets only the latest output
        assert lengths == sorted(set(lengths)) and lengths[0] >= 1 and lengths[-1] == 8
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        assert all(outs[-1].token_ids[: len(o.token_ids)] == o.token_ids for o in outs)
    assert sync.has_unfinished() is False


def test_abort_and_early_exit_free_the_pools(async_engine):
    async def main():
        stream = async_engine.generate(random_ids(30, 1), greedy(200), request_id="a")
        first = await stream.__anext__()
        await stream.aclose()  # consumer goes away (client disconnect)
        task = asyncio.create_task(_collect(async_engine, random_ids(30, 2), greedy(200), rid="b"))
        await asyncio.sleep(0.2)
        await async_engine.abort("b")
        outs = await task
        await asyncio.sleep(0.2)
        return first, outs

    first, outs = asyncio.run(main())
    assert first.finish_reason is None and outs[-1].finish_reason == "abort"
    stats = async_engine.stats()
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["num_live_slots_free"] == async_engine.engine.cache.pools.live.count


def test_bad_prompt_raises_before_streaming(async_engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await _collect(async_engine, [], greedy(4))
        return await _collect(async_engine, random_ids(5, 3), greedy(3))

    assert asyncio.run(main())[-1].finish_reason == "length"


def test_duplicate_request_id_is_refused_without_touching_the_first(async_engine):
    async def main():
        first = asyncio.create_task(_collect(async_engine, random_ids(10, 4), greedy(300), rid="dup"))
        await asyncio.sleep(0.1)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(async_engine, random_ids(10, 5), greedy(3), rid="dup")
        return await first

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 300


def test_min_interval_yields_first_and_last_and_loses_no_token(async_engine):
    """A reader asking for an hour between outputs gets the first output at once and then only the finished one,
    which holds every token; a reader asking for none gets every step (or the latest when it falls behind)."""

    async def main():
        params = greedy(24)
        slow = [o async for o in async_engine.generate(random_ids(12, 5), params, min_interval_s=lambda: 3600.0)]
        fast = await _collect(async_engine, random_ids(12, 5), params)
        return slow, fast

    slow, fast = asyncio.run(main())
    assert len(slow) == 2 and len(slow[0].token_ids) >= 1 and not slow[0].finished
    assert slow[1].finished and slow[1].token_ids == fast[-1].token_ids and len(fast[-1].token_ids) == 24
    assert len(fast) > 2
