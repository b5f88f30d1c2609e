"""Tensor parallelism inside one engine (CPU, gloo): `Engine(EngineConfig(tp=N))` runs N rank processes.

Oracles: the same engine at tp=1 (itself checked against transformers in test_parity.py) for tokens and fp32
logprobs; a cold prefill of exactly a snapshot's tokens, on the same rank of a tp engine without a prefix cache,
for every published snapshot; the process table of this test process for the rank processes' lifetime."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.distributed.worker_group import RankFailedError
from tests.engine.cache_helpers import snapshot_errors
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.engine.tp_helpers import child_pids, mixed_prompts, wait_gone

C = 16  # chunk size of the tiny model (extra_buffer grid with page 16)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tp_engine(path: str, tp: int, **kw) -> Engine:
    base = dict(max_num_seqs=8, max_num_batched_tokens=24, num_kv_pages=24, page_size=4, mamba_cache_strategy="off")
    base.update(kw)
    return make_engine(path, tp=tp, **base)


def _assert_same(out, ref, tol: float = 1e-5) -> None:
    for o, r in zip(out, ref, strict=True):
        assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason)
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs, strict=True)) <= tol


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_greedy_tokens_and_logprobs_equal_tp1(tiny_model_dir, tp):
    """8 prompts of mixed lengths in one packed batch, chunked prefill (24-token budget) and preemption (24 pages
    of 4 tokens for 8 requests needing 166 tokens): identical greedy tokens, fp32 logprobs within 1e-5. Then
    garbage collection of the engine ends its rank processes."""
    ref_eng = _tp_engine(tiny_model_dir, 1)
    vocab = ref_eng.model_config.vocab_size
    prompts = mixed_prompts(vocab, seed=7)
    params = [greedy(8, logprobs=True)] * len(prompts)
    ref = ref_eng.generate(prompts, params)
    assert ref_eng.num_preemptions > 0, "the workload must preempt"
    before = child_pids()
    eng = _tp_engine(tiny_model_dir, tp)
    ranks = {p.pid for p in eng.workers.procs}
    assert len(ranks) == tp and ranks <= child_pids() - before
    _assert_same(eng.generate(prompts, params), ref)
    assert eng.num_preemptions == ref_eng.num_preemptions
    del eng
    gc.collect()
    assert wait_gone(ranks, 15.0) == set()


@pytest.mark.parametrize("strategy,page_size", [("extra_buffer", 16), ("no_buffer", 1)])
def test_tp2_prefix_cache_matches_off_and_snapshots_equal_cold_on_every_rank(tiny_model_dir, strategy, page_size):
    """An unaligned packed multi-turn workload: turn 2 extends each turn-1 conversation with its answer and new
    text. Same tokens as `off` at tp 2, tokens served from the cache, and every published snapshot equals a cold
    prefill of its prefix on each rank."""
    kw = dict(max_num_batched_tokens=256, num_kv_pages=None, page_size=page_size)
    off = _tp_engine(tiny_model_dir, 2, **kw)
    cached = _tp_engine(tiny_model_dir, 2, mamba_cache_strategy=strategy, **kw)
    try:
        vocab = off.model_config.vocab_size
        first = [random_ids(n, 100 + n, vocab) for n in (C + 3, 2 * C + 7, 5)]
        ref1 = off.generate(first, greedy(6))
        out1 = cached.generate(first, greedy(6))
        assert [o.token_ids for o in out1] == [r.token_ids for r in ref1]
        second = [p + o.token_ids + random_ids(9 + i, 200 + i, vocab) for i, (p, o) in enumerate(zip(first, ref1))]
        ref2 = off.generate(second, greedy(6, logprobs=True))
        out2 = cached.generate(second, greedy(6, logprobs=True))
        _assert_same(out2, ref2, tol=1e-4)
        assert sum(o.num_cached_tokens for o in out2) > 0
        errors = snapshot_errors(cached, off)
        assert errors and max(errors.values()) <= 1e-5, errors
    finally:
        off.shutdown()
        cached.shutdown()


def test_tp2_rank_killed_mid_generation_raises_and_leaves_no_orphans(tiny_model_dir):
    """SIGKILL of rank 1 while requests decode: the next steps raise RankFailedError naming the rank within
    seconds (no hang on a collective), every rank process of the engine is gone, and the engine keeps refusing."""
    eng = _tp_engine(tiny_model_dir, 2)
    ranks = [p.pid for p in eng.workers.procs]
    for prompt in mixed_prompts(eng.model_config.vocab_size, seed=3)[:4]:
        eng.add_request(prompt, greedy(40))
    for _ in range(3):
        eng.step()
    os.kill(ranks[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - start < 10.0
    assert wait_gone(ranks, 10.0) == set()
    assert not set(ranks) & child_pids()
    with pytest.raises(RankFailedError):
        eng.step()
    with pytest.raises(RankFailedError):
        eng.check_alive()


def test_tp2_killed_engine_process_ends_its_ranks(tiny_model_dir, tmp_path):
    """The engine's process is SIGKILLed (no shutdown, no finalizers): its rank processes exit on their own."""
    script = (
        "import sys, time\n"
        "from service.engine import Engine, EngineConfig\n"
        f"e = Engine(EngineConfig(model_path={tiny_model_dir!r}, tp=2, max_num_seqs=2))\n"
        "print(' '.join(str(p.pid) for p in e.workers.procs), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        ranks = [int(x) for x in proc.stdout.readline().split()]
        assert len(ranks) == 2 and set(ranks) <= child_pids(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(ranks, 10.0) == set()


@pytest.mark.parametrize("strategy", ["no_buffer", "off"])
def test_tp2_abort_with_a_step_in_flight_frees_everything(tiny_model_dir, strategy):
    """Abort while a launched step holds the request: pages and slots are all free (the ids every rank's tensors
    are indexed by), the published state (no_buffer) equals a cold prefill on every rank, and the other request
    decodes as at tp 1."""
    kw = dict(page_size=1, max_num_batched_tokens=256, num_kv_pages=None)
    off = _tp_engine(tiny_model_dir, 2, **kw) if strategy == "no_buffer" else None
    eng = _tp_engine(tiny_model_dir, 2, mamba_cache_strategy=strategy, **kw)
    try:
        vocab = eng.model_config.vocab_size
        a, b = random_ids(20, 21, vocab), random_ids(9, 22, vocab)
        rid_a, rid_b = eng.add_request(a, greedy(30)), eng.add_request(b, greedy(12))
        for _ in range(5):
            eng.step()
        assert eng._inflight is not None and eng._inflight.sched.new_tokens_of(eng.requests[rid_a]) > 0
        aborted = eng.abort(rid_a)
        assert aborted.finish_reason == "abort"
        final = {}
        while eng.has_unfinished():
            final.update({o.request_id: o for o in eng.step() if o.finished})
        alone = _tp_engine(tiny_model_dir, 1, **kw).generate([b], greedy(12))[0]
        assert final[rid_b].token_ids == alone.token_ids
        pools = eng.cache.pools
        assert pools.live.num_free == pools.live.count
        if strategy == "off":
            assert pools.pages.num_free == pools.pages.num_usable
        else:
            errors = snapshot_errors(eng, off)
            assert len(a) + len(aborted.token_ids) in errors, errors
            assert max(errors.values()) <= 1e-5, errors
    finally:
        eng.shutdown()
        if off is not None:
            off.shutdown()


def test_tp_config_errors_name_what_to_change(tiny_model_dir):
    with pytest.raises(ValueError, match="ep must be 1 .* or equal to tp=2"):
        Engine(EngineConfig(model_path=tiny_model_dir, tp=2, ep=4))
    with pytest.raises(ValueError, match="tp must be >= 1"):
        Engine(EngineConfig(model_path=tiny_model_dir, tp=0))


def test_tp2_seeded_sampling_equals_tp1(tiny_model_dir):
    """Sampling runs on rank 0 only: seeded random sampling and top logprobs come out as at tp 1."""
    prompts = mixed_prompts(256, seed=11)[:3]
    params = [
        SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=5 + i, top_logprobs=2, ignore_eos=True)
        for i in range(3)
    ]
    ref = _tp_engine(tiny_model_dir, 1).generate(prompts, params)
    eng = _tp_engine(tiny_model_dir, 2)
    try:
        out = eng.generate(prompts, params)
    finally:
        eng.shutdown()
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert [sorted(d) for d in o.top_logprobs] == [sorted(d) for d in r.top_logprobs]
