"""Prefix cache, state level: every published snapshot equals a cold run of its prefix (docs/design.md: Prefix cache, Testing)."""

from __future__ import annotations

import pytest
import torch

import service.engine.runner.batch as batch_mod
from service.engine.canary import max_rel_error
from tests.engine.cache_helpers import buggy_snapshot_chunk_indices, cold_state, snapshot_errors
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.outputs import assert_same_outputs

C = 16  # chunk size of the mixed_g2_c16 checkpoint
UNALIGNED_FIRST = [2 * C + 3, 3 * C - 1, C + 1, C - 3, C, 2 * C, 3 * C + 1, 4 * C - 1]


def _engines(path, page_size, **kw):
    cached = make_engine(
        path, page_size=page_size, mamba_cache_strategy="extra_buffer", max_num_batched_tokens=1024, **kw
    )
    off = make_engine(path, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    return cached, off


def _run_packed(engine, lengths, seed=0, max_tokens=3):
    for i, n in enumerate(lengths):
        engine.add_request(random_ids(n, seed + i), greedy(max_tokens))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("page_size", [4, 16, 32])  # smaller than, equal to and larger than C
def test_packed_batch_first_request_unaligned(mixed_ckpt, page_size):
    cached, off = _engines(mixed_ckpt, page_size)
    _run_packed(cached, UNALIGNED_FIRST)
    errors = snapshot_errors(cached, off)
    grid = cached.cache.grid
    expected = {(n // grid) * grid for n in UNALIGNED_FIRST if n >= grid}
    assert expected <= set(errors), f"missing snapshots: {expected - set(errors)}"
    assert max(errors.values()) <= 1e-5, errors


def test_mutation_cumsum_offsets_is_caught(mixed_ckpt, monkeypatch):
    """Re-introducing the `cumsum(l_j // C)` offset must make the state-level check fail."""
    monkeypatch.setattr(batch_mod, "snapshot_chunk_indices", buggy_snapshot_chunk_indices)
    cached, off = _engines(mixed_ckpt, 4)
    _run_packed(cached, UNALIGNED_FIRST)
    errors = snapshot_errors(cached, off)
    assert max(errors.values()) > 1e-3, "the buggy offsets went unnoticed"


def test_mixed_hit_and_cold_and_decode_in_one_step(mixed_ckpt):
    cached, off = _engines(mixed_ckpt, 4)
    prefix = random_ids(2 * C + 5, 100)
    cached.generate([prefix + random_ids(7, 101)], greedy(3))
    long_runner = cached.add_request(random_ids(C + 2, 102), greedy(40))
    cached.step()  # long_runner is now decoding
    hit = cached.add_request(prefix + random_ids(C + 9, 103), greedy(4))
    cold = cached.add_request(random_ids(3 * C - 1, 104), greedy(4))
    outs = {}
    while cached.has_unfinished():
        for o in cached.step():
            outs[o.request_id] = o
    assert outs[hit].num_cached_tokens == 2 * C and outs[cold].num_cached_tokens == 0
    assert long_runner in outs and len(outs[long_runner].token_ids) == 40
    errors = snapshot_errors(cached, off)
    assert max(errors.values()) <= 1e-5, errors


def test_chunked_prefill_split_mid_grid(mixed_ckpt):
    """Token budget 7: extends start mid-chunk (p % C != 0); grid snapshots still exact."""
    cached = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="extra_buffer", max_num_batched_tokens=7)
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    _run_packed(cached, [3 * C + 5, 2 * C + 1])
    errors = snapshot_errors(cached, off)
    assert {C, 2 * C, 3 * C} <= set(errors) and max(errors.values()) <= 1e-5, errors


def test_no_buffer_hit_mid_chunk(mixed_ckpt):
    """page_size 1: the finished request's state is published at an unaligned length; a hit resumes mid-chunk."""
    cached = make_engine(mixed_ckpt, page_size=1, mamba_cache_strategy="no_buffer", max_num_batched_tokens=1024)
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    first = cached.generate([random_ids(C + 5, 7)], greedy(4))[0]
    computed = first.prompt_token_ids + first.token_ids[:-1]
    assert len(computed) % C != 0
    follow = computed + random_ids(2 * C + 1, 8)
    out = cached.generate([follow], greedy(6, logprobs=True))[0]
    ref = off.generate([follow], greedy(6, logprobs=True))[0]
    assert out.num_cached_tokens == len(computed)
    assert_same_outputs(out, ref, 1e-4)
    errors = snapshot_errors(cached, off)
    assert len(errors) == 2 and max(errors.values()) <= 1e-5, errors


def test_branching_point_snapshot_is_hit_by_third_request(mixed_ckpt):
    cached, off = _engines(mixed_ckpt, 4, mamba_track_interval=None)
    shared = random_ids(2 * C + 5, 11)
    a = cached.generate([shared + random_ids(C + 3, 12)], greedy(2))[0]
    assert a.num_cached_tokens == 0
    b = cached.generate([shared + random_ids(9, 13)], greedy(2))[0]
    assert b.num_cached_tokens == 0 and cached.stats()["mamba_snapshot_misses"] == 1
    c = cached.generate([shared + random_ids(11, 14)], greedy(2, logprobs=True))[0]
    assert c.num_cached_tokens == 2 * C, "the third request should resume from the branching snapshot"
    ref = off.generate([shared + random_ids(11, 14)], greedy(2, logprobs=True))[0]
    assert c.token_ids == ref.token_ids
    errors = snapshot_errors(cached, off)
    assert 2 * C in errors and max(errors.values()) <= 1e-5, errors


def test_decode_after_hit_matches_cold_and_source_unchanged(mixed_ckpt):
    cached, off = _engines(mixed_ckpt, 4)
    prefix = random_ids(3 * C + 2, 21)
    cached.generate([prefix], greedy(2))
    tree, pools = cached.cache.tree, cached.runner.pools  # the rank-0 state tensors (tp 1)
    ((node, depth),) = [(n, d) for n, d in tree.snapshot_prefix_lengths() if d == 3 * C]
    before = pools.conv[:, node.snapshot_slot].clone(), pools.ssm[:, node.snapshot_slot].clone()
    prompt = prefix + random_ids(5, 22)
    out = cached.generate([prompt], greedy(70, logprobs=True))[0]
    ref = off.generate([prompt], greedy(70, logprobs=True))[0]
    assert out.num_cached_tokens == 3 * C
    assert_same_outputs(out, ref, 1e-4)
    assert node.snapshot_slot is not None
    assert torch.equal(pools.conv[:, node.snapshot_slot], before[0])
    assert torch.equal(pools.ssm[:, node.snapshot_slot], before[1])


def test_cold_state_oracle_detects_a_wrong_prefix(mixed_ckpt):
    """Sanity check of the oracle itself: states of different prefixes differ clearly."""
    off = make_engine(mixed_ckpt, mamba_cache_strategy="off", max_num_batched_tokens=1024)
    (a,) = cold_state(off, random_ids(2 * C, 31))  # tp 1: one rank's state
    (b,) = cold_state(off, random_ids(2 * C, 32))
    assert max_rel_error(a[1], b[1]) > 1e-2 and max_rel_error(a[0], b[0]) > 1e-2


def test_repeat_of_grid_aligned_prompt_hits(mixed_ckpt):
    """A prompt whose length is a multiple of the grid is resumable at the grid point below its end."""
    cached, off = _engines(mixed_ckpt, 4)
    prompt = random_ids(3 * C, 41)
    cached.generate([prompt], greedy(2))
    again = cached.generate([prompt], greedy(4, logprobs=True))[0]
    ref = off.generate([prompt], greedy(4, logprobs=True))[0]
    assert again.num_cached_tokens == 2 * C and again.token_ids == ref.token_ids
    errors = snapshot_errors(cached, off)
    assert {2 * C, 3 * C} <= set(errors) and max(errors.values()) <= 1e-5, errors
