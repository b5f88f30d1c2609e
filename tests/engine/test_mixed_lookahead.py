"""Mixed steps launched ahead (docs/design.md: Scheduler and runner): while a step is in flight, the next one holds
the decode rows of its requests (their input token is the in-flight step's sample, carried on the device) and
the prefill chunks whose tokens are known: the next chunk of a request mid-prefill and the first chunks of
requests admitted now.

Oracles: the same engine with `async_scheduling=False` (one step at a time, every token read before the next step
is scheduled), and for cached states a cold prefill of exactly the tokens a snapshot is keyed by."""

from __future__ import annotations

import pytest

from service.engine import Engine, SamplingParams
from service.engine.canary import max_rel_error
from tests.engine.cache_helpers import cold_state, snapshot_errors
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.marks import needs_cuda
from tests.outputs import assert_same_outputs

C = 16  # chunk size of the mixed_g2_c16 checkpoint
LOGPROB_TOL = 1e-5  # fp32 rounding of a different batch shape (a wasted row, a chunk cut elsewhere)
PAGE_SIZE = {"off": 4, "extra_buffer": 4, "no_buffer": 1}  # no_buffer keys states by token: page_size 1


def _engine(ckpt: str, strategy: str, **kw):
    """Three seats, a budget that cuts long prompts into several chunks, a short max_model_len, every step's
    invariants checked (debug_integrity)."""
    base = dict(
        page_size=PAGE_SIZE[strategy],
        mamba_cache_strategy=strategy,
        max_num_seqs=3,
        max_num_batched_tokens=24,
        max_model_len=80,
    )
    return make_engine(ckpt, **{**base, **kw})


def _workload(stop_token: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Nine requests for three seats: long prompts (chunked), prompts that extend others (cache hits),
    greedy and seeded sampling with logprobs, a stop token, max_tokens 1, and one that ends at max_model_len."""
    base, short = random_ids(40, 5), random_ids(12, 10)
    prompts = [
        base + random_ids(9, 6),
        random_ids(7, 7),
        random_ids(53, 8),
        base + random_ids(21, 9),
        short,  # its state is published when it ends (no_buffer) and hit by the last request
        base + random_ids(3, 11),
        random_ids(70, 12),
        random_ids(30, 13),
        short + random_ids(20, 14),
    ]
    params = [
        greedy(9, logprobs=True),
        SamplingParams(max_tokens=11, temperature=0.8, seed=7, logprobs=True),
        greedy(6, logprobs=True),
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_token,), logprobs=True),
        greedy(1, logprobs=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.9, seed=3, top_logprobs=3, logprobs=True),
        greedy(30, logprobs=True),  # 70 + 10 = max_model_len: ends by length after 10 tokens
        greedy(5, logprobs=True),
        greedy(9, logprobs=True),
    ]
    return prompts, params


@pytest.mark.parametrize(
    "strategy, ssm_dtype",
    [("off", "float32"), ("extra_buffer", "float32"), ("no_buffer", "float32"), ("off", "bfloat16")],
)
def test_mixed_steps_ahead_equal_one_step_at_a_time(mixed_ckpt, strategy, ssm_dtype):
    """More requests than seats, chunked prompts (bf16 states: cut at chunk ends), prefix-cache hits: the same
    tokens, finish reasons and logprobs as the synchronous engine, with steps that hold prefill chunks launched
    ahead; every state the async engine cached equals a cold prefill of its key."""
    kw = dict(mamba_ssm_cache_dtype=ssm_dtype)
    sync = _engine(mixed_ckpt, strategy, async_scheduling=False, **kw)
    probe = sync.generate([random_ids(40, 5) + random_ids(21, 9)], greedy(12))[0].token_ids
    prompts, params = _workload(stop_token=probe[4])
    sync = _engine(mixed_ckpt, strategy, async_scheduling=False, **kw)
    ref = sync.generate(prompts, params)
    eng = _engine(mixed_ckpt, strategy, **kw)
    assert eng.scheduler.prefill_align == (C if ssm_dtype == "bfloat16" else 0)
    out = eng.generate(prompts, params)
    assert_same_outputs(out, ref, LOGPROB_TOL, finish_reason=True, top_logprob_ids=True)
    assert ref[3].finish_reason == "stop" and len(ref[3].token_ids) == 5
    assert ref[6].finish_reason == "length" and len(ref[6].token_ids) == 10
    assert sync.num_steps_ahead == 0 and sync.num_prefill_steps_ahead == 0
    assert eng.num_prefill_steps_ahead >= 5, (eng.num_prefill_steps_ahead, eng.num_steps)
    assert eng.num_steps_ahead >= eng.num_steps - 6, (eng.num_steps_ahead, eng.num_steps)
    _assert_all_free(eng)
    if strategy != "off":
        assert eng.stats()["prefix_cache_hit_tokens"] > 0
        off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
        errors = snapshot_errors(eng, off)
        assert errors and max(errors.values()) <= 1e-5, errors


def _assert_all_free(eng) -> None:
    """Nothing is in flight or running, and only the prefix cache holds slots and pages."""
    assert eng._inflight is None and not eng.scheduler.running and not eng.scheduler.waiting
    pools = eng.cache.pools
    assert pools.live.num_free == pools.live.count
    assert not eng.cache.pending_slots  # every planned snapshot was published or dropped
    if eng.cache.tree is None:
        assert pools.pages.num_free == pools.pages.num_usable
    eng.check_integrity()


def _in_flight_chunk(eng, rid: str, with_snapshots: bool):
    """rid's row in the in-flight step when it is a prefill chunk (taking snapshots if asked), else None."""
    rows = [s for s in eng._inflight.sched.scheduled if s.request.request_id == rid] if eng._inflight else []
    if rows and rows[0].num_new_tokens > 1 and (rows[0].snapshots or not with_snapshots):
        return rows[0]
    return None


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "off"])
def test_abort_while_a_prefill_chunk_is_in_flight(mixed_ckpt, strategy):
    """A request aborted while a launched step feeds it a prefill chunk (with snapshots under extra_buffer):
    its slots and pages are freed, its planned snapshots are dropped, a published state (no_buffer) is keyed by
    the chunk's tokens too and equals a cold prefill of them, and the other requests decode as without it."""
    keep = [random_ids(n, 40 + n) for n in (9, 23, 5)]
    victim = random_ids(61, 77)
    eng = _engine(mixed_ckpt, strategy)
    rids = [eng.add_request(p, greedy(8, logprobs=True)) for p in keep[:2]]
    rid_v = eng.add_request(victim, greedy(8))
    rids.append(eng.add_request(keep[2], greedy(8, logprobs=True)))
    steps = 0
    while (row := _in_flight_chunk(eng, rid_v, strategy == "extra_buffer")) is None:
        eng.step()
        steps += 1
        assert steps < 40, "the victim's prefill never ran in a step launched ahead"
    assert row.request.num_computed_tokens == row.prefix_len  # the chunk is not counted yet
    assert {pt.slot_id for pt in row.snapshots} <= eng.cache.pending_slots
    aborted = eng.abort(rid_v)
    assert aborted.finish_reason == "abort" and not aborted.token_ids
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    _assert_all_free(eng)
    ref = _engine(mixed_ckpt, strategy, async_scheduling=False).generate(keep, greedy(8, logprobs=True))
    assert_same_outputs([final[r] for r in rids], ref, LOGPROB_TOL, finish_reason=True)
    if strategy == "no_buffer":
        off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
        errors = snapshot_errors(eng, off)
        assert row.prefix_len + row.num_new_tokens in errors, (errors, row)
        assert max(errors.values()) <= 1e-5, errors


def test_requests_added_between_steps_join_steps_launched_ahead(mixed_ckpt):
    """Requests that arrive while steps are launched ahead are admitted into the next step launched ahead (the
    pipeline does not drain for them) and give the tokens they give one step at a time."""
    eng = _engine(mixed_ckpt, "off", max_num_seqs=4)
    a = random_ids(30, 91)
    rid_a = eng.add_request(a, greedy(20, logprobs=True))
    for _ in range(3):
        eng.step()
    late = [random_ids(n, 92 + n) for n in (11, 37)]
    ahead0 = eng.num_prefill_steps_ahead
    rids = [eng.add_request(p, greedy(6, logprobs=True)) for p in late]
    final = {}
    while eng.has_unfinished():
        assert eng._inflight is not None  # the pipeline never drains while a request runs
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.num_prefill_steps_ahead >= ahead0 + 2  # 37 tokens over a budget of 24: two chunks
    sync = _engine(mixed_ckpt, "off", async_scheduling=False)
    assert_same_outputs(final[rid_a], sync.generate([a], greedy(20, logprobs=True))[0], LOGPROB_TOL)
    assert_same_outputs([final[r] for r in rids], sync.generate(late, greedy(6, logprobs=True)), LOGPROB_TOL)


def test_request_capturing_states_is_not_launched_ahead(mixed_ckpt):
    """A request that captures states joins while others decode in steps launched ahead: it is admitted (the
    look-ahead stops for it), its captured post-prompt state is the state after exactly its prompt (a cold
    prefill), and the pipeline resumes after it."""
    eng = _engine(mixed_ckpt, "off", max_num_seqs=4, max_num_batched_tokens=64)
    rid_a = eng.add_request(random_ids(20, 61), greedy(24))
    for _ in range(3):
        eng.step()
    prompt = random_ids(37, 62)
    rid_b = eng.add_request(prompt, greedy(4), capture_states=True)
    ahead0 = eng.num_steps_ahead
    final = {}
    while eng.has_unfinished():
        final.update({o.request_id: o for o in eng.step() if o.finished})
    assert set(final) == {rid_a, rid_b}
    captured = eng.pop_captured_states(rid_b)["prompt"]
    assert captured.num_tokens == len(prompt)
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    ((conv, ssm),) = cold_state(off, prompt)
    assert max_rel_error(captured.conv, conv) <= 1e-5 and max_rel_error(captured.ssm, ssm) <= 1e-5
    assert eng.num_steps_ahead >= ahead0 + 10  # a's decode after b is done


@pytest.mark.gpu
@needs_cuda
def test_mixed_steps_ahead_with_graphs_equal_one_step_at_a_time(tiny_model_dir):
    """CUDA graphs + triton kernels, steps split into a replayed decode part and an eager prefill part: carried
    tokens reach both parts on the device, and the outputs equal one step at a time's (more requests than seats,
    chunked prompts, seeded sampling, a stop token)."""

    def engine(async_scheduling: bool) -> Engine:
        return make_engine(
            tiny_model_dir,
            device="cuda",
            kernel_backend="triton",
            dtype="float32",
            max_num_seqs=4,
            max_num_batched_tokens=32,
            async_scheduling=async_scheduling,
            debug_integrity=False,
        )

    sync = engine(False)
    vocab = sync.model_config.vocab_size
    prompts = [random_ids(n, 200 + n, vocab) for n in (9, 45, 5, 70, 17, 33, 3, 52, 12, 28)]
    probe = sync.generate([prompts[4]], greedy(10))[0].token_ids
    params = [greedy(6 + i % 5, logprobs=True) for i in range(len(prompts))]
    params[4] = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(probe[3],), logprobs=True)
    params[7] = SamplingParams(max_tokens=9, temperature=0.9, seed=11, logprobs=True)
    ref = sync.generate(prompts, params)
    eng = engine(True)
    assert_same_outputs(eng.generate(prompts, params), ref, 1e-4, finish_reason=True)
    assert ref[4].finish_reason == "stop"
    assert eng.num_prefill_steps_ahead >= 5, (eng.num_prefill_steps_ahead, eng.num_steps)
    assert eng.runner.num_split_steps >= 3 and eng.runner.graphs.num_replays >= 10


def _decode_snapshot_in_flight(eng, rid: str):
    """rid's row in the in-flight step when it decodes one token and takes a snapshot there, else None."""
    rows = [s for s in eng._inflight.sched.scheduled if s.request.request_id == rid] if eng._inflight else []
    return rows[0] if rows and rows[0].num_new_tokens == 1 and rows[0].snapshots else None


def test_last_request_aborted_with_a_snapshot_in_flight_leaves_nothing_held(mixed_ckpt):
    """The only request is aborted while the step launched ahead decodes its next token and snapshots it there:
    the engine reads that step at once and drops the planned snapshot (nobody steps an engine without requests,
    so a step left in flight would hold its snapshot slot until the next request came)."""
    eng = _engine(mixed_ckpt, "extra_buffer", max_model_len=120)
    rid = eng.add_request(random_ids(9, 81), greedy(100))
    steps = 0
    while _decode_snapshot_in_flight(eng, rid) is None:
        eng.step()
        steps += 1
        assert steps < 40, "no decode snapshot ran in a step launched ahead"
    assert eng.cache.pending_slots
    assert eng.abort(rid).finish_reason == "abort"
    assert not eng.has_unfinished()
    _assert_all_free(eng)


def test_last_request_stopping_with_a_snapshot_in_flight_leaves_nothing_held(mixed_ckpt):
    """The only request stops on a token that the step launched ahead already feeds (a wasted row) and that row
    takes a snapshot: the step that returns the stop reads the wasted one too, and nothing stays held."""
    prompt = random_ids(9, 82)
    probe = _engine(mixed_ckpt, "extra_buffer", max_model_len=120)
    rid = probe.add_request(prompt, greedy(100))
    fed = []  # output indices of the tokens fed by decode rows that snapshot in a step launched ahead
    while probe.has_unfinished() and len(fed) < 4:
        row = _decode_snapshot_in_flight(probe, rid)
        if row is not None and row.prefix_len - len(prompt) not in fed:
            fed.append(row.prefix_len - len(prompt))
        out = probe.step()
    tokens = probe.requests[rid].output_token_ids if rid in probe.requests else out[0].token_ids
    q = next((q for q in fed if tokens[q] not in tokens[:q]), None)
    assert q is not None, (fed, tokens)  # a stop token that first occurs where a wasted row snapshots
    eng = _engine(mixed_ckpt, "extra_buffer", max_model_len=120)
    eng.add_request(prompt, SamplingParams(max_tokens=100, temperature=0.0, stop_token_ids=(tokens[q],)))
    final = []
    while eng.has_unfinished():
        final += [o for o in eng.step() if o.finished]
    assert [o.finish_reason for o in final] == ["stop"] and list(final[0].token_ids) == list(tokens[: q + 1])
    _assert_all_free(eng)
