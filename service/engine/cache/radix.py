"""Radix tree over token ids at page granularity, owning KV pages and optional mamba snapshots.

A node's span is a whole number of pages. `node.snapshot_slot` (optional) holds the conv + SSM
state after the node's last token. A prefix match returns the deepest *fully matched* node with a
snapshot (KV alone cannot resume a hybrid model); nodes without one are tombstones.

Invariants (`check_integrity`):
- every node except the root has a span of >= 1 page, len(page_ids) == len(tokens) // page_size;
- a child's key equals the first page of its span, children's first pages are distinct;
- depth(node) == depth(parent) + len(node.tokens);
- lock_ref(node) >= sum of children's lock_ref... (locks propagate to the root) and >= 0;
- each tree page holds exactly one tree reference (refcount >= 1); each snapshot slot is owned by
  exactly one node and is in use in the snapshot allocator.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from service.engine.cache.pools import SlotPools


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]  # token ids of this node's span (multiple of page_size)
    page_ids: list[int]  # KV page per page_size tokens of the span
    parent: Node | None
    depth: int  # tokens from the root to the end of this node
    snapshot_slot: int | None = None  # mamba slot with the state after the span's last token
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # first page tokens -> child
    lock_ref: int = 0  # running requests (or copy sources) depending on this path
    last_access: int = 0  # logical clock for LRU


@dataclass(frozen=True)
class Match:
    node: Node  # deepest fully matched node with a snapshot (root if none)
    num_cached_tokens: int  # node.depth: tokens resumable from the snapshot
    page_ids: list[int]  # KV pages covering [0, num_cached_tokens)
    num_kv_matched_tokens: int  # deepest page-aligned KV match (>= num_cached_tokens)


class RadixCache:
    def __init__(self, pools: SlotPools, page_size: int):
        self.pools = pools
        self.page_size = page_size
        self.root = Node(tokens=(), page_ids=[], parent=None, depth=0)
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        # (last_access, id, node) of nodes that got a snapshot; stale entries are re-keyed or dropped lazily
        self._snapshot_heap: list[tuple[int, int, Node]] = []
        self.num_evicted_pages = 0  # KV pages freed by eviction
        self.num_evicted_snapshots = 0  # snapshots dropped by eviction

    # ---------- lookup ----------
    def match(self, token_ids: list[int], max_tokens: int) -> Match:
        """Deepest resumable prefix of token_ids[:max_tokens] (max_tokens: keep >= 1 token to recompute)."""
        ps, now = self.page_size, next(self._clock)
        node, pos = self.root, 0
        best, best_pages = self.root, []
        pages: list[int] = []
        while pos + ps <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.tokens, token_ids, pos)
            pages.extend(child.page_ids[: n // ps])
            pos += n
            child.last_access = now
            if n < len(child.tokens):
                break
            node = child
            if node.snapshot_slot is not None and node.depth <= max_tokens:
                best, best_pages = node, list(pages)
        return Match(best, best.depth, best_pages, pos)

    def _common_pages(self, span: tuple[int, ...], token_ids: list[int], pos: int) -> int:
        ps, n = self.page_size, 0
        while (
            n < len(span)
            and pos + n + ps <= len(token_ids)
            and span[n : n + ps] == tuple(token_ids[pos + n : pos + n + ps])
        ):
            n += ps
        return n

    # ---------- insertion ----------
    def insert(self, token_ids: list[int], page_ids: list[int], snapshot_slot: int | None) -> bool:
        """Adds the path token_ids (page-aligned) with the caller's page_ids (the tree takes its own
        references on pages of new spans). Attaches snapshot_slot at the end if that node has none.
        Returns True if the tree took ownership of snapshot_slot."""
        ps = self.page_size
        assert len(token_ids) % ps == 0 and len(page_ids) == len(token_ids) // ps, "insert must be page aligned"
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(token_ids):
            key = tuple(token_ids[pos : pos + ps])
            child = node.children.get(key)
            if child is None:
                span = tuple(token_ids[pos:])
                new_pages = page_ids[pos // ps :]
                self.pools.pages.incref(new_pages)
                child = Node(span, list(new_pages), node, node.depth + len(span), last_access=now)
                node.children[key] = child
                node, pos = child, len(token_ids)
                break
            n = self._common_pages(child.tokens, token_ids, pos)
            if n < len(child.tokens):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        if snapshot_slot is None or node is self.root or node.snapshot_slot is not None:
            return False
        node.snapshot_slot = snapshot_slot
        heapq.heappush(self._snapshot_heap, (node.last_access, id(node), node))
        return True

    def _split(self, node: Node, n: int) -> Node:
        """Splits node after n tokens; returns the new upper node (no snapshot: a tombstone)."""
        ps = self.page_size
        parent = node.parent
        upper = Node(
            node.tokens[:n],
            node.page_ids[: n // ps],
            parent,
            node.depth - len(node.tokens) + n,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        parent.children[node.tokens[:ps]] = upper
        node.tokens, node.page_ids, node.parent = node.tokens[n:], node.page_ids[n // ps :], upper
        upper.children[node.tokens[:ps]] = node
        return upper

    # ---------- locking ----------
    def lock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            node = node.parent

    # ---------- eviction ----------
    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict_pages(self, num_pages: int) -> int:
        """Evicts LRU unlocked leaves until num_pages pages became free; returns pages freed.
        One tree walk builds a heap of leaves; parents that become leaves join it."""
        heap = [(n.last_access, id(n), n) for n in self._nodes() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _evictable_leaf(self, n: Node) -> bool:
        return n is not self.root and not n.children and n.lock_ref == 0

    def _remove_leaf(self, leaf: Node) -> int:
        if leaf.snapshot_slot is not None:
            self.pools.snapshots.free(leaf.snapshot_slot)
            self.num_evicted_snapshots += 1
            leaf.snapshot_slot = None
        del leaf.parent.children[leaf.tokens[: self.page_size]]
        freed = self.pools.pages.decref(leaf.page_ids)
        self.num_evicted_pages += len(leaf.page_ids)
        return freed

    def evict_snapshot(self) -> bool:
        """Drops the LRU unlocked snapshot (inner nodes become tombstones). False if none can go.
        Amortised O(log n): heap entries whose node was touched since are re-keyed, freed ones dropped."""
        locked: list[tuple[int, int, Node]] = []
        victim = None
        while self._snapshot_heap:
            entry = heapq.heappop(self._snapshot_heap)
            node = entry[2]
            if node.snapshot_slot is None:
                continue
            if entry[0] != node.last_access:
                heapq.heappush(self._snapshot_heap, (node.last_access, id(node), node))
            elif node.lock_ref > 0:
                locked.append(entry)
            else:
                victim = node
                break
        for entry in locked:
            heapq.heappush(self._snapshot_heap, entry)
        if victim is None:
            return False
        self.pools.snapshots.free(victim.snapshot_slot)
        victim.snapshot_slot = None
        self.num_evicted_snapshots += 1
        return True

    # ---------- introspection ----------
    def snapshot_prefix_lengths(self) -> list[tuple[Node, int]]:
        return [(n, n.depth) for n in self._nodes() if n.snapshot_slot is not None]

    def path_tokens(self, node: Node) -> list[int]:
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.tokens)
            node = node.parent
        return [t for span in reversed(parts) for t in span]

    def check_integrity(self, pending_snapshot_slots: frozenset[int] = frozenset()) -> None:
        """pending_snapshot_slots: snapshot slots allocated for this step, not yet published."""
        ps = self.page_size
        slots_seen: set[int] = set()
        for n in self._nodes():
            if n is self.root:
                continue
            assert len(n.tokens) >= ps and len(n.tokens) % ps == 0, "span not page aligned"
            assert len(n.page_ids) == len(n.tokens) // ps, "pages do not cover the span"
            assert n.parent.children.get(n.tokens[:ps]) is n, "child key mismatch"
            assert n.depth == n.parent.depth + len(n.tokens), "depth mismatch"
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), "lock not propagated"
            assert n.lock_ref >= 0
            for p in n.page_ids:
                assert self.pools.pages.refcount[p] >= 1, f"tree page {p} is free"
            if n.snapshot_slot is not None:
                assert n.snapshot_slot not in slots_seen, "snapshot slot owned twice"
                assert n.snapshot_slot in self.pools.snapshots.in_use, "snapshot slot not allocated"
                slots_seen.add(n.snapshot_slot)
        assert slots_seen == self.pools.snapshots.in_use - pending_snapshot_slots, "snapshot slots leaked"
