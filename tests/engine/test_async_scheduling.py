"""Async scheduling (docs/design.md: Scheduler and runner): the next step is launched before the current step's tokens are read.

Oracle: the same engine with `async_scheduling=False` (one step at a time, every token read before the next
step is scheduled), and for cached states a cold prefill of exactly the tokens a snapshot is keyed by."""

from __future__ import annotations

import pytest

from service.engine import Engine, EngineConfig, SamplingParams
from tests.engine.cache_helpers import snapshot_errors
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.marks import needs_cuda
from tests.outputs import assert_same_outputs

C = 16  # chunk size of the mixed_g2_c16 checkpoint


def _run(engine, prompts, params):
    return engine.generate(prompts, params)


def _assert_same(out, ref) -> None:
    """Same tokens, finish reasons and top-logprob ids; logprobs equal up to fp32 batch-shape rounding (a row
    wasted on a stopped request changes the batch's shape)."""
    assert_same_outputs(out, ref, 1e-5, finish_reason=True, top_logprob_ids=True)


def _params_mix(stop_token: int) -> list[SamplingParams]:
    return [
        greedy(12),
        greedy(3),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, logprobs=True),
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.9, seed=3, top_logprobs=3),
        greedy(1),
    ]


def test_async_equals_sync_outputs(mixed_ckpt):
    """Greedy, seeded sampling, logprobs, top logprobs, stop tokens and max_tokens: same outputs either way,
    with most decode steps launched ahead."""
    prompts = [random_ids(n, 40 + n) for n in (5, 17, 9, 33, 12, 3)]
    sync = make_engine(mixed_ckpt, async_scheduling=False)
    probe = sync.generate([prompts[3]], greedy(10))[0].token_ids
    params = _params_mix(stop_token=probe[4])  # request 3 stops on its 5th token
    ref = _run(sync, prompts, params)
    eng = make_engine(mixed_ckpt)
    _assert_same(_run(eng, prompts, params), ref)
    assert ref[3].finish_reason == "stop" and len(ref[3].token_ids) == 5
    assert ref[4].top_logprobs is not None and ref[2].logprobs is not None
    assert sync.num_steps_ahead == 0 and eng.num_steps_ahead >= 6


def test_stop_while_next_step_in_flight_publishes_the_right_state(mixed_ckpt):
    """no_buffer publishes a finished request's live state. A request that stops while the next step is in
    flight has that step feed its last token: the published state must be keyed by every token (prompt and
    all outputs) and equal a cold prefill of them; a later request that hits it decodes like a cold one."""
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    prompt = random_ids(C + 5, 11)
    probe = off.generate([prompt], greedy(8))[0].token_ids
    k = next(i for i in range(2, 8) if probe[i] not in probe[:i])  # stop on a token not seen before
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(probe[k],))
    cached = make_engine(mixed_ckpt, page_size=1, mamba_cache_strategy="no_buffer", max_num_batched_tokens=1024)
    first = cached.generate([prompt], stop)[0]
    assert first.finish_reason == "stop" and first.token_ids == probe[: k + 1]
    assert cached.num_steps_ahead > 0
    errors = snapshot_errors(cached, off)
    key_len = len(prompt) + k + 1  # a sync engine publishes one token less (those it computed)
    assert list(errors) == [key_len], errors
    assert max(errors.values()) <= 1e-5, errors
    follow = prompt + first.token_ids + random_ids(C + 3, 12)
    out = cached.generate([follow], greedy(6, logprobs=True))[0]
    ref = off.generate([follow], greedy(6, logprobs=True))[0]
    assert out.num_cached_tokens == key_len
    assert_same_outputs(out, ref, 1e-4)


@pytest.mark.parametrize("strategy", ["no_buffer", "off"])
def test_abort_with_a_step_in_flight(mixed_ckpt, strategy):
    """Aborting between steps while a launched step holds the request: everything is freed, a published state
    (no_buffer) equals a cold prefill of its key, and the other request decodes as if alone."""
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    eng = make_engine(mixed_ckpt, page_size=1, mamba_cache_strategy=strategy, max_num_batched_tokens=1024)
    a, b = random_ids(20, 21), random_ids(9, 22)
    rid_a = eng.add_request(a, greedy(30))
    rid_b = eng.add_request(b, greedy(12))
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None and eng._inflight.sched.new_tokens_of(eng.requests[rid_a]) > 0
    aborted = eng.abort(rid_a)
    assert aborted.finish_reason == "abort"
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final[rid_b].token_ids == off.generate([b], greedy(12))[0].token_ids
    pools = eng.cache.pools
    assert pools.live.num_free == pools.live.count
    if strategy == "off":
        assert pools.pages.num_free == pools.pages.num_usable
    if strategy == "no_buffer":
        errors = snapshot_errors(eng, off)
        assert len(a) + len(aborted.token_ids) in errors, errors
        assert max(errors.values()) <= 1e-5, errors


def test_new_request_is_not_delayed_behind_the_pipeline(mixed_ckpt):
    """A request added while steps are being launched ahead is admitted into the next step launched ahead, gets
    its first token one step later, and both requests give the tokens they give alone."""
    eng = make_engine(mixed_ckpt)
    alone = make_engine(mixed_ckpt, async_scheduling=False)
    a, b = random_ids(7, 31), random_ids(11, 32)
    rid_a = eng.add_request(a, greedy(16))
    for _ in range(4):
        eng.step()
    rid_b = eng.add_request(b, greedy(5))
    eng.step()  # launches b's prefill (with a's next decode) ahead; returns the in-flight step's tokens
    eng.step()  # returns b's first token
    assert eng.requests[rid_b].output_token_ids
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert final[rid_a].token_ids == alone.generate([a], greedy(16))[0].token_ids
    assert final[rid_b].token_ids == alone.generate([b], greedy(5))[0].token_ids


@pytest.mark.gpu
@needs_cuda
def test_async_graph_replays_equal_sync(tiny_model_dir):
    """CUDA graphs + triton kernels: the next step's input tokens are copied on the device from the in-flight
    step's samples (the host never sees them first); the same outputs as one step at a time, with requests that
    stop, sample with seeds, ask for logprobs, and one that arrives while the pipeline runs."""

    def run(async_scheduling: bool):
        eng = Engine(
            EngineConfig(
                model_path=tiny_model_dir,
                device="cuda",
                kernel_backend="triton",
                dtype="float32",
                mamba_cache_strategy="off",
                page_size=4,
                max_num_seqs=8,
                max_num_batched_tokens=64,
                async_scheduling=async_scheduling,
            )
        )
        prompts = [random_ids(n, 60 + n, eng.model_config.vocab_size) for n in (5, 17, 9, 33, 12, 3)]
        probe = eng.generate([prompts[3]], greedy(10))[0].token_ids
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, _params_mix(stop_token=probe[4]))]
        final, steps = {}, 0
        while eng.has_unfinished() or len(rids) < 7:
            if steps == 6:
                rids.append(eng.add_request(random_ids(21, 99, eng.model_config.vocab_size), greedy(9)))
            final.update({o.request_id: o for o in eng.step() if o.finished})
            steps += 1
            assert steps < 500
        return [final[r] for r in rids], eng

    ref, sync = run(False)
    out, eng = run(True)
    _assert_same(out, ref)
    assert sync.num_steps_ahead == 0 and eng.num_steps_ahead >= 6
    assert eng.runner.graphs.num_replays >= 10
