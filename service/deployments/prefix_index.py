"""The prefix-aware router's brain, free of Ray: an approximate per-replica index of cached prefix
blocks and the scoring rule that picks a replica (docs/design.md: Serving).

A prompt is cut into blocks of `block_size_tokens` (the engine's snapshot grid G) and hashed with
`chained_block_hashes`, so hash k names the whole prefix of k+1 blocks. Each replica's index is an
LRU set of such hashes: filled when a request is dispatched there, pruned to the replica's own
report (`cached_prefix_hashes`) when one arrives, keeping entries dispatched since the report
could have seen them.

Decision for one request over candidates r (all numbers router-local, no remote calls):
    frac_r  = matched_blocks_r / total_blocks               (0 when the prompt has no full block)
    load_r  = requests in flight on r, counted at dispatch
    score_r = w_prefix * frac_r - w_load * load_r / max(1, max_r load_r)
The best-scoring replica wins if it matched something and its load does not exceed the least-loaded
candidate's by `max_load_imbalance` or more (per-request gate); otherwise (gated, out-scored by an
unmatched replica, or nothing matched) the least-loaded replica wins (ties: fewest requests ever
dispatched, then fewest indexed blocks, then id).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

# prefix: affinity won; load_gate: the best match was gated by load imbalance; load_score: a matching replica
# existed but the load term made an unmatched one score higher; miss: no replica matched; no_prompt: not a
# generate call (nothing to hash); fallback: the first-ranked replica refused (full), a later-ranked one took it.
Reason = Literal["prefix", "load_gate", "load_score", "miss", "no_prompt", "fallback"]
REASONS: tuple[Reason, ...] = ("prefix", "load_gate", "load_score", "miss", "no_prompt", "fallback")


@dataclass(frozen=True)
class RouterPolicy:
    """Scoring knobs; mirrors `args.RouterArgs`."""

    w_prefix: float = 1.0  # weight of the matched/total prefix fraction
    w_load: float = 0.5  # weight of the normalised in-flight load
    max_load_imbalance: int = 8  # gate: skip affinity if target has >= this many more in flight than the least loaded
    index_capacity_blocks: int = 200_000  # LRU capacity of one replica's index, in blocks
    report_grace_s: float = 30.0  # dispatch-inserted entries younger than this survive a replica report


@dataclass(frozen=True)
class ReplicaView:
    """What the scorer knows about one candidate replica at decision time."""

    replica_key: Hashable  # the replica's id (any hashable; Ray's ReplicaID in the router)
    matched_blocks: int  # leading prompt blocks present in this replica's index
    in_flight: int  # requests dispatched and not yet completed
    dispatched_total: int  # requests ever dispatched here (tie-break for balance)
    indexed_blocks: int  # index size (tie-break: emptier cache first)


@dataclass(frozen=True)
class Decision:
    """The outcome for one request."""

    ranking: tuple[Hashable, ...]  # replica keys, most preferred first; ranking[0] is the choice
    reason: Reason  # why ranking[0] was chosen
    predicted_hit_ratio: float  # matched/total blocks of the chosen replica, in [0, 1]


class ReplicaPrefixIndex:
    """LRU set of chained block hashes believed cached on one replica."""

    def __init__(self, capacity_blocks: int, clock: Callable[[], float] = time.monotonic):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._capacity_blocks = capacity_blocks
        self._clock = clock
        self._entries: OrderedDict[int, float] = OrderedDict()  # block hash -> time inserted/refreshed by dispatch

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def match_blocks(self, block_hashes: Sequence[int]) -> int:
        """Number of leading hashes present (a chained hash implies its whole prefix)."""
        n = 0
        for h in block_hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def insert(self, block_hashes: Iterable[int]) -> None:
        """Record a dispatch: these prefixes will be cached there; refresh them as most recent."""
        now = self._clock()
        for h in block_hashes:
            self._entries[h] = now
            self._entries.move_to_end(h)
        while len(self._entries) > self._capacity_blocks:
            self._entries.popitem(last=False)

    def apply_report(self, reported_hashes: Iterable[int], grace_s: float) -> None:
        """Correct the index with the replica's own view: drop what it no longer caches unless it
        was dispatched within `grace_s` (the report may predate it); add what it reports."""
        reported = set(reported_hashes)
        cutoff = self._clock() - grace_s
        for h in [h for h, t in self._entries.items() if h not in reported and t < cutoff]:
            del self._entries[h]
        for h in reported:
            if h not in self._entries:
                self._entries[h] = cutoff  # known cached, but not refreshed by a dispatch
                self._entries.move_to_end(h, last=False)
        while len(self._entries) > self._capacity_blocks:
            self._entries.popitem(last=False)


def _least_loaded_order(views: Sequence[ReplicaView]) -> list[ReplicaView]:
    return sorted(views, key=lambda v: (v.in_flight, v.dispatched_total, v.indexed_blocks, str(v.replica_key)))


def decide(views: Sequence[ReplicaView], total_blocks: int, policy: RouterPolicy, has_prompt: bool = True) -> Decision:
    """Rank candidates for one request (see module docstring). `views` must be non-empty."""
    if not views:
        raise ValueError("decide() needs at least one candidate replica")
    by_load = _least_loaded_order(views)
    if not has_prompt:
        return Decision(tuple(v.replica_key for v in by_load), "no_prompt", 0.0)
    max_load = max(1, max(v.in_flight for v in views))
    min_load = by_load[0].in_flight

    def frac(v: ReplicaView) -> float:
        return v.matched_blocks / total_blocks if total_blocks > 0 else 0.0

    def score(v: ReplicaView) -> float:
        return policy.w_prefix * frac(v) - policy.w_load * v.in_flight / max_load

    matching = [v for v in views if v.matched_blocks > 0]
    if not matching:
        return Decision(tuple(v.replica_key for v in by_load), "miss", 0.0)
    best = max(views, key=lambda v: (score(v), frac(v), -v.in_flight))
    if frac(best) == 0.0:
        chosen, reason = by_load[0], "load_score"
    elif best.in_flight - min_load >= policy.max_load_imbalance:
        chosen, reason = by_load[0], "load_gate"
    else:
        chosen, reason = best, "prefix"
    rest = sorted((v for v in views if v is not chosen), key=lambda v: (-score(v), v.in_flight))
    ranking = (chosen.replica_key,) + tuple(v.replica_key for v in rest)
    return Decision(ranking, reason, frac(chosen))
