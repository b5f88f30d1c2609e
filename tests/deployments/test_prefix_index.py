"""The router's index and scoring, without Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.deployments.prefix_index import (
    REASONS,
    ReplicaPrefixIndex,
    ReplicaView,
    RouterPolicy,
    decide,
)
from service.engine.cache.block_hash import chained_block_hashes

G = 4  # block size in tokens


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_match_counts_leading_blocks_of_a_shared_prefix():
    index = ReplicaPrefixIndex(capacity_blocks=100)
    a = list(range(16))  # 4 blocks
    b = a[:8] + [99] + a[9:]  # diverges inside block 2
    index.insert(chained_block_hashes(a, G))
    assert index.match_blocks(chained_block_hashes(a, G)) == 4
    assert index.match_blocks(chained_block_hashes(b, G)) == 2
    assert index.match_blocks(chained_block_hashes([7] + a[1:], G)) == 0
    assert index.match_blocks(chained_block_hashes(a + [1, 2, 3, 4], G)) == 4


def test_lru_capacity_evicts_least_recently_dispatched():
    index = ReplicaPrefixIndex(capacity_blocks=4)
    old, new = chained_block_hashes(list(range(8)), G), chained_block_hashes(list(range(100, 108)), G)
    index.insert(old)
    index.insert(new)
    index.insert(old)  # refresh: `new` is now the oldest
    index.insert(chained_block_hashes(list(range(200, 208)), G))
    assert len(index) == 4
    assert index.match_blocks(old) == 2 and index.match_blocks(new) == 0


def test_report_prunes_stale_keeps_recent_and_adds_reported():
    clock = FakeClock()
    index = ReplicaPrefixIndex(capacity_blocks=100, clock=clock)
    stale = chained_block_hashes(list(range(8)), G)
    index.insert(stale)
    clock.now += 60
    recent = chained_block_hashes(list(range(50, 58)), G)
    index.insert(recent)
    reported = chained_block_hashes(list(range(900, 912)), G)
    clock.now += 1
    index.apply_report(reported, grace_s=30)
    assert index.match_blocks(stale) == 0  # evicted on the replica, dispatched long ago
    assert index.match_blocks(recent) == 2  # dispatched after the report could see it
    assert index.match_blocks(reported) == 3  # the replica says it has it
    clock.now += 60
    index.apply_report([], grace_s=30)
    assert len(index) == 0


def _view(key, matched=0, load=0, total=0, size=0):
    return ReplicaView(
        replica_key=key, matched_blocks=matched, in_flight=load, dispatched_total=total, indexed_blocks=size
    )


def test_miss_goes_to_least_loaded_then_least_used():
    policy = RouterPolicy()
    d = decide([_view("a", load=2), _view("b", load=1), _view("c", load=1, total=5)], 4, policy)
    assert d.ranking == ("b", "c", "a") and d.reason == "miss" and d.predicted_hit_ratio == 0.0


def test_prefix_affinity_beats_small_load_difference():
    d = decide([_view("a", matched=4, load=3), _view("b", load=0)], 4, RouterPolicy(w_prefix=1, w_load=0.5))
    assert d.ranking[0] == "a" and d.reason == "prefix" and d.predicted_hit_ratio == 1.0


def test_load_term_can_outscore_a_weak_match():
    d = decide([_view("a", matched=1, load=4), _view("b", load=0)], 10, RouterPolicy(w_prefix=1, w_load=0.5))
    assert d.ranking[0] == "b" and d.reason == "load_score"


def test_per_request_gate_skips_affinity_only_for_overloaded_target():
    policy = RouterPolicy(w_prefix=1, w_load=0.0, max_load_imbalance=3)
    gated = decide([_view("a", matched=4, load=5), _view("b", load=2)], 4, policy)
    assert gated.ranking[0] == "b" and gated.reason == "load_gate"
    kept = decide([_view("a", matched=4, load=4), _view("b", load=2)], 4, policy)
    assert kept.ranking[0] == "a" and kept.reason == "prefix"


def test_no_prompt_and_empty_candidates():
    d = decide([_view("a", load=1), _view("b")], 0, RouterPolicy(), has_prompt=False)
    assert d.ranking == ("b", "a") and d.reason == "no_prompt"
    with pytest.raises(ValueError, match="candidate"):
        decide([], 3, RouterPolicy())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 20), st.integers(0, 50)), min_size=1, max_size=6),
    st.integers(0, 8),
    st.floats(0, 4),
    st.floats(0, 4),
    st.integers(1, 10),
)
def test_decision_invariants(rows, total, w_prefix, w_load, gate):
    views = [_view(i, matched=min(m, total), load=l, total=t) for i, (m, l, t) in enumerate(rows)]
    policy = RouterPolicy(w_prefix=w_prefix, w_load=w_load, max_load_imbalance=gate)
    d = decide(views, total, policy)
    assert sorted(d.ranking) == list(range(len(views)))  # a permutation of the candidates
    assert 0.0 <= d.predicted_hit_ratio <= 1.0 and d.reason in REASONS
    chosen = views[d.ranking[0]]
    min_load = min(v.in_flight for v in views)
    assert chosen.in_flight - min_load < gate or chosen.in_flight == min_load  # the gate always holds
    if d.reason in ("miss", "load_gate", "load_score"):
        assert chosen.in_flight == min_load


def _simulate(order, n_replicas, policy, prompt_of):
    """Sequential dispatch through index + decide; returns (replica per request, hit blocks)."""
    indexes = [ReplicaPrefixIndex(policy.index_capacity_blocks) for _ in range(n_replicas)]
    totals = [0] * n_replicas
    placed, hits = [], 0
    for req in order:
        hashes = chained_block_hashes(prompt_of(req), G)
        views = [
            _view(i, matched=indexes[i].match_blocks(hashes), total=totals[i], size=len(indexes[i]))
            for i in range(n_replicas)
        ]
        r = decide(views, len(hashes), policy).ranking[0]
        hits += views[r].matched_blocks
        indexes[r].insert(hashes)
        totals[r] += 1
        placed.append(r)
    return placed, hits


@pytest.mark.parametrize("interleaved", [True, False])
def test_shared_prefix_groups_stick_and_balance(interleaved):
    groups, per_group = 8, 8
    order = (
        [(g, i) for i in range(per_group) for g in range(groups)]
        if interleaved
        else [(g, i) for g in range(groups) for i in range(per_group)]
    )
    prompt_of = lambda req: [1000 * (req[0] + 1) + t for t in range(32)] + [req[1], 7]  # 8 shared blocks
    placed, hits = _simulate(order, 2, RouterPolicy(), prompt_of)
    by_group = {g: {placed[k] for k, req in enumerate(order) if req[0] == g} for g in range(groups)}
    assert all(len(rs) == 1 for rs in by_group.values())  # every group stays on one replica
    counts = [placed.count(r) for r in range(2)]
    assert max(counts) <= 2 * min(counts)
    assert hits == groups * (per_group - 1) * 8  # all repeats hit the whole prefix
