"""Hybrid cache manager: pages, live slots and the mamba radix cache behind one interface.

Strategies (docs/design.md: Prefix cache): `off` (no prefix cache), `no_buffer` (page_size 1; the live state is
published when a request finishes), `extra_buffer` (snapshots on the grid G = lcm(chunk, page):
the last grid point of each extend, the branching point, and every `track_interval` decode tokens).

Slot protocol: snapshot slots are allocated when a step is scheduled, filled by that step's forward,
and published to the tree only after it (`publish`); a hit copies the snapshot into a fresh live
slot before the forward (copy-on-write; cached slots are never written); at least one prompt token
is always recomputed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from service.engine.cache.pools import SlotPools
from service.engine.cache.radix import RadixCache
from service.engine.distributed.step import SnapshotPoint
from service.engine.request import Request


@dataclass
class CacheCounters:
    queried_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # prompt tokens served from cache
    snapshot_hits: int = 0  # lookups that resumed from a snapshot
    snapshot_misses: int = 0  # lookups whose KV matched deeper than the deepest snapshot


class CacheManager:
    def __init__(self, pools: SlotPools, strategy: str, page_size: int, chunk_size: int, track_interval: int | None):
        self.pools, self.strategy, self.page_size = pools, strategy, page_size
        self.grid = page_size if strategy == "no_buffer" else math.lcm(chunk_size, page_size)
        if track_interval is not None and track_interval % self.grid:
            raise ValueError(
                f"mamba_track_interval ({track_interval}) must be a multiple of the snapshot grid "
                f"lcm(chunk_size, page_size) = {self.grid}"
            )
        self.track_interval = track_interval or self.grid
        self.tree = RadixCache(pools, page_size) if strategy != "off" else None
        self.counters = CacheCounters()
        self.pending_slots: set[int] = set()  # snapshot slots allocated this step, not yet published
        self.publish_copies: list[tuple[int, int]] = []  # (live slot, snapshot slot) the ranks have not copied yet

    # ---------- admission ----------
    def admit(self, req: Request, num_new_tokens_budget: int) -> int | None:
        """Gives req a live slot, reuses the longest cached prefix and allocates pages for its first chunk.
        Returns the number of tokens to schedule, or None if memory is short (nothing is held then)."""
        if self.pools.live.num_free == 0:
            return None
        hit_pages: list[int] = []
        num_cached, node = 0, None
        if self.tree is not None and not req.bypass_cache:
            m = self.tree.match(req.all_token_ids, req.num_tokens - 1)
            num_cached, node, hit_pages = m.num_cached_tokens, m.node, m.page_ids
            req.branch_point = (
                (m.num_kv_matched_tokens // self.grid) * self.grid if m.num_kv_matched_tokens > num_cached else 0
            )
        n = min(req.num_tokens - num_cached, num_new_tokens_budget)
        need = self._pages_for(num_cached + n) - len(hit_pages)
        hit_node = node if num_cached > 0 else None
        if hit_node is not None:
            self.tree.lock(hit_node)  # protects the hit's pages and snapshot while we may evict
        if not self._reserve_pages(need):
            if hit_node is not None:
                self.tree.unlock(hit_node)
            return None
        self.pools.pages.incref(hit_pages)
        req.page_ids = hit_pages + self.pools.pages.alloc(need)
        req.live_slot = self.pools.live.alloc()
        req.num_computed_tokens = num_cached
        req.cache_node = hit_node
        self._count_lookup(req, num_cached)
        return n

    def _count_lookup(self, req: Request, num_cached: int) -> None:
        if req.bypass_cache:
            return
        if req.num_preemptions == 0:
            self.counters.queried_tokens += len(req.prompt_token_ids)
            self.counters.hit_tokens += num_cached
            req.num_cached_tokens = num_cached
        self.counters.snapshot_hits += int(num_cached > 0)
        self.counters.snapshot_misses += int(req.branch_point > num_cached)

    def initial_slot_copy(self, req: Request) -> tuple[int, int] | None:
        """(src snapshot slot, dst live slot) for a hit, else None (the live slot must be zeroed)."""
        if req.cache_node is None:
            return None
        return req.cache_node.snapshot_slot, req.live_slot

    # ---------- pages ----------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _reserve_pages(self, need: int) -> bool:
        short = need - self.pools.pages.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict_pages(short)
        return self.pools.pages.num_free >= need

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Ensures req has pages for positions [0, num_tokens); False if memory is short."""
        need = self._pages_for(num_tokens) - len(req.page_ids)
        if need <= 0:
            return True
        if not self._reserve_pages(need):
            return False
        req.page_ids.extend(self.pools.pages.alloc(need))
        return True

    # ---------- snapshots ----------
    @property
    def plans_snapshots(self) -> bool:
        """Whether a step's rows may take snapshots (extra_buffer)."""
        return self.strategy == "extra_buffer"

    def plan_snapshots(
        self, req: Request, prefix_len: int, num_new_tokens: int, decode: bool
    ) -> tuple[SnapshotPoint, ...]:
        """Snapshot points of the extend (p, p+n] (p = prefix_len) under extra_buffer, with slots allocated now.
        decode: one token after at least one output (the interval grid applies, not the extend's)."""
        if not self.plans_snapshots or req.bypass_cache:
            return ()
        points = []
        for s in sorted(self._snapshot_positions(req, prefix_len, num_new_tokens, decode)):
            slot = self._alloc_snapshot_slot()
            if slot is None:
                break
            points.append(SnapshotPoint(s, slot))
        return tuple(points)

    def drop_snapshots(self, points: tuple[SnapshotPoint, ...]) -> None:
        """Frees the slots of planned snapshots that will not be published (their request ended while the step
        that fills them was in flight; a later step writes a reused slot after that one in device order)."""
        for pt in points:
            self.pending_slots.discard(pt.slot_id)
            self.pools.snapshots.free(pt.slot_id)

    def _snapshot_positions(self, req: Request, p: int, num_new_tokens: int, decode: bool) -> set[int]:
        """Grid positions in (p, p+n] to snapshot under extra_buffer: a decode step every track_interval tokens,
        an extend its last grid point (and the one below if the extend ends there), and the branch point."""
        if self.strategy != "extra_buffer" or req.bypass_cache:
            return set()
        g, end = self.grid, p + num_new_tokens
        positions = set()
        if decode:
            if end % self.track_interval == 0:
                positions.add(end)
        else:
            last = (end // g) * g
            if last > p:
                positions.add(last)
            if last == req.num_tokens and last - g > p:  # a repeat must recompute >= 1 token:
                positions.add(last - g)  # keep the grid point below the end too
        if p < req.branch_point <= end:
            positions.add(req.branch_point)
        return positions

    def _alloc_snapshot_slot(self) -> int | None:
        if self.pools.snapshots.num_free == 0 and not self.tree.evict_snapshot():
            return None
        slot = self.pools.snapshots.alloc()
        self.pending_slots.add(slot)
        return slot

    def publish(self, req: Request, points: tuple[SnapshotPoint, ...]) -> None:
        """After the forward: insert each snapshot (and its KV path) into the tree."""
        tokens = req.all_token_ids
        for pt in points:
            self.pending_slots.discard(pt.slot_id)
            pages = req.page_ids[: pt.position // self.page_size]
            if not self.tree.insert(tokens[: pt.position], pages, pt.slot_id):
                self.pools.snapshots.free(pt.slot_id)

    # ---------- release ----------
    def release(self, req: Request, finished: bool) -> None:
        """Frees everything req holds. Under no_buffer a finished request's live state is published."""
        if req.live_slot is None:
            return
        if finished and self.strategy == "no_buffer" and req.num_computed_tokens > 0 and not req.bypass_cache:
            self._publish_final_state(req)
        self.pools.live.free(req.live_slot)
        self.pools.pages.decref(req.page_ids)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.page_ids, req.live_slot, req.cache_node = [], None, None

    def _publish_final_state(self, req: Request) -> None:
        """no_buffer: copy the live state into a snapshot slot keyed by the computed sequence."""
        n = req.num_computed_tokens
        if self.tree.match(req.all_token_ids[:n], n).num_cached_tokens == n:
            return  # already cached
        if self.pools.snapshots.num_free == 0 and not self.tree.evict_snapshot():
            return
        slot = self.pools.snapshots.alloc()
        self.publish_copies.append((req.live_slot, slot))  # before anything reuses the live slot (take_publish_copies)
        if not self.tree.insert(req.all_token_ids[:n], req.page_ids[:n], slot):
            self.pools.snapshots.free(slot)

    def take_publish_copies(self) -> tuple[tuple[int, int], ...]:
        """The (live slot, snapshot slot) copies recorded since the last call: the ranks must run them before any
        later device work (the live slot is free now and may be zeroed or written by the next step)."""
        out, self.publish_copies = tuple(self.publish_copies), []
        return out

    def check_integrity(self) -> None:
        self.pools.check_integrity()
        if self.tree is not None:
            self.tree.check_integrity(frozenset(self.pending_slots))
