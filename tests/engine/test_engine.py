"""Engine behaviour: batch invariance, chunked prefill, preemption, sampling, stops, bad input."""

from __future__ import annotations

import pytest

from service.engine import SamplingParams
from tests.engine.helpers import greedy, make_engine, random_ids

LENGTHS = (5, 17, 40, 33, 2, 70, 16, 9)


@pytest.fixture(scope="module")
def alone(mixed_ckpt):
    engine = make_engine(mixed_ckpt)
    return [engine.generate([random_ids(n, i)], greedy(20))[0].token_ids for i, n in enumerate(LENGTHS)]


def _prompts():
    return [random_ids(n, i) for i, n in enumerate(LENGTHS)]


def test_batch_invariance(mixed_ckpt, alone):
    together = make_engine(mixed_ckpt).generate(_prompts(), greedy(20))
    assert [o.token_ids for o in together] == alone


def test_chunked_prefill_small_budget(mixed_ckpt, alone):
    engine = make_engine(mixed_ckpt, max_num_batched_tokens=7)
    assert [o.token_ids for o in engine.generate(_prompts(), greedy(20))] == alone


def test_preemption_gives_same_results(mixed_ckpt, alone):
    engine = make_engine(mixed_ckpt, num_kv_pages=30, max_num_batched_tokens=64)
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda req: (preempted.append(req.request_id), original(req))
    outs = engine.generate(_prompts(), greedy(20))
    assert preempted, "the pool was meant to be too small for all requests"
    assert [o.token_ids for o in outs] == alone
    assert engine.cache.pools.pages.num_free == engine.cache.pools.pages.num_usable


def test_seeded_sampling_is_reproducible_and_batch_independent(mixed_ckpt):
    engine = make_engine(mixed_ckpt)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=123, ignore_eos=True)
    a = engine.generate([random_ids(10, 1)], sp)[0].token_ids
    batch = engine.generate([random_ids(30, 2), random_ids(10, 1)], [greedy(5), sp])
    assert batch[1].token_ids == a
    other = engine.generate(
        [random_ids(10, 1)], SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    )[0]
    assert other.token_ids != a


def test_top_k_one_equals_greedy(mixed_ckpt):
    engine = make_engine(mixed_ckpt)
    ids = random_ids(20, 3)
    g = engine.generate([ids], greedy(10))[0].token_ids
    k1 = engine.generate([ids], SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True))[0]
    assert k1.token_ids == g


def test_top_logprobs_and_stop_token(mixed_ckpt):
    engine = make_engine(mixed_ckpt)
    ids = random_ids(20, 4)
    out = engine.generate([ids], greedy(10, logprobs=True, top_logprobs=3))[0]
    assert len(out.logprobs) == len(out.top_logprobs) == 10
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert max(top.values()) == pytest.approx(lp, abs=1e-6) and tok in top
    stop_at = out.token_ids[4]
    stopped = engine.generate([ids], greedy(10, stop_token_ids=(stop_at,)))[0]
    assert stopped.token_ids[-1] == stop_at and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) == out.token_ids.index(stop_at) + 1


def test_stop_strings_with_tokenizer(tiny_model_dir):
    engine = make_engine(tiny_model_dir, page_size=16)
    free = engine.generate(["The weather is"], greedy(24))[0]
    assert free.text, "the tiny model should produce text"
    stop = free.text[3:6]
    out = engine.generate(["The weather is"], greedy(24, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and stop not in out.text
    assert free.text.startswith(out.text) and len(out.text) == free.text.index(stop)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(min_p=2.0), "min_p"),
        (dict(top_k=-5), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_do_not_disturb_other_requests(mixed_ckpt):
    engine = make_engine(mixed_ckpt)
    ok = engine.add_request(random_ids(12, 5), greedy(8))
    for prompt, word in (([], "empty"), (list(range(3, 3 + 1024)), "max_model_len"), ([5, 999999], "token id")):
        with pytest.raises(ValueError, match=word):
            engine.add_request(prompt, greedy(4))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[ok].finish_reason == "length" and len(outs[ok].token_ids) == 8


def test_abort_frees_everything(mixed_ckpt):
    engine = make_engine(mixed_ckpt, mamba_cache_strategy="off")
    rid = engine.add_request(random_ids(40, 6), greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.cache.pools.pages.num_free < engine.cache.pools.pages.num_usable
    out = engine.abort(rid)
    assert out.finish_reason == "abort"
    assert engine.cache.pools.pages.num_free == engine.cache.pools.pages.num_usable
    assert engine.cache.pools.live.num_free == engine.cache.pools.live.count
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(mamba_cache_strategy="no_buffer", page_size=4), "page_size=1"),
        (dict(mamba_cache_strategy="extra_buffer", mamba_track_interval=24), "multiple of the snapshot grid"),
        (dict(mamba_cache_strategy="extra_buffer", max_mamba_snapshots=0), "max_mamba_snapshots"),
        (dict(mamba_cache_strategy="lru"), "mamba_cache_strategy"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(page_size=0), "page_size"),
    ],
)
def test_bad_engine_options(mixed_ckpt, kwargs, words):
    with pytest.raises(ValueError, match=words):
        make_engine(mixed_ckpt, **kwargs)


def test_kv_pool_too_small_for_one_request(mixed_ckpt):
    """A prompt larger than the whole pool is refused; a lone request that outgrows the pool ends with
    "length" instead of preempting itself forever; the engine keeps serving."""
    engine = make_engine(mixed_ckpt, page_size=4, num_kv_pages=6)  # 24 tokens in all
    with pytest.raises(ValueError, match="num_kv_pages"):
        engine.add_request(random_ids(30, 1), greedy(4))
    out = engine.generate([random_ids(10, 2)], greedy(50))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24 - 10 + 1
    assert engine.generate([random_ids(5, 3)], greedy(3))[0].finish_reason == "length"
    assert engine.cache.pools.pages.num_free == engine.cache.pools.pages.num_usable
