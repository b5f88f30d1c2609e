"""Memory pool ids: paged KV pages (ref-counted) and mamba state slots (docs/design.md: Prefix cache).

The tensors live on every rank (runner/state_tensors.py); the allocators here, on the engine's side, hand out
the ids that index them. Page ids index the KV tensor `[L_attn, 2, num_pages * page_size, Hkv, Dh]`; page 0 is
a reserved scratch page (padding target), never handed out. Slot ids index the mamba tensors
`conv [L_mamba, S, conv_dim, K-1]` and `ssm [L_mamba, S, H, P, N]` (fp32); slot 0 is scratch.
Live slots (one per running request) and snapshot slots (owned by the radix cache) come from
separate ranges so each is bounded on its own."""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class PagePool:
    """Ref-counted page allocator. A page is free iff its refcount is 0."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_kv_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages  # including the reserved page 0
        self.page_size = page_size  # tokens per page
        self.refcount = [0] * num_pages  # page_id -> number of owners (requests + radix nodes)
        self.free_ids = list(range(num_pages - 1, 0, -1))  # stack of free page ids

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise MemoryError(f"need {n} KV pages, {len(self.free_ids)} free")
        ids = [self.free_ids.pop() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self.refcount[i] > 0, f"incref of free page {i}"
            self.refcount[i] += 1

    def decref(self, ids: list[int]) -> int:
        """Drops one reference from each page; returns how many pages became free."""
        freed = 0
        for i in ids:
            assert self.refcount[i] > 0, f"decref of free page {i}"
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self.free_ids.append(i)
                freed += 1
        return freed

    def check_integrity(self) -> None:
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "page freed twice"
        assert 0 not in free and self.refcount[0] == 0, "reserved page 0 handed out"
        for i in range(1, self.num_pages):
            assert (self.refcount[i] == 0) == (i in free), f"page {i}: refcount {self.refcount[i]} vs free list"


class SlotAllocator:
    """Free slots over a contiguous range of mamba slot ids; `alloc` hands out the lowest free id, so requests
    admitted together get one ascending run of slots, which the torch bundle's decode steps update in place on a
    view of the pool (no gather / scatter)."""

    def __init__(self, first: int, count: int, kind: str):
        self.kind = kind  # "live" | "snapshot", for messages
        self.first, self.count = first, count
        self.free_ids = list(range(first, first + count))  # a min-heap (heapq) of free slot ids
        self.in_use: set[int] = set()  # slot ids handed out

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def alloc(self) -> int:
        if not self.free_ids:
            raise MemoryError(f"no free {self.kind} mamba slot")
        slot = heapq.heappop(self.free_ids)
        self.in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self.in_use, f"{self.kind} slot {slot} freed but not in use"
        self.in_use.remove(slot)
        heapq.heappush(self.free_ids, slot)

    def check_integrity(self) -> None:
        assert len(set(self.free_ids)) == len(self.free_ids), f"{self.kind} slot freed twice"
        assert not (set(self.free_ids) & self.in_use), f"{self.kind} slot both free and in use"
        assert len(self.free_ids) + len(self.in_use) == self.count, f"{self.kind} slots leaked"


@dataclass(frozen=True)
class PoolSizes:
    num_kv_pages: int  # including reserved page 0
    num_live_slots: int  # running requests at most
    num_snapshot_slots: int  # prefix-cache snapshots at most

    @property
    def num_slots(self) -> int:
        """Mamba slots including scratch slot 0."""
        return 1 + self.num_live_slots + self.num_snapshot_slots


class SlotPools:
    """The id allocators of the state pools (the engine's side; every rank's tensors are indexed by these ids)."""

    def __init__(self, sizes: PoolSizes, page_size: int):
        self.sizes = sizes
        self.pages = PagePool(sizes.num_kv_pages, page_size)
        self.live = SlotAllocator(1, sizes.num_live_slots, "live")
        self.snapshots = SlotAllocator(1 + sizes.num_live_slots, sizes.num_snapshot_slots, "snapshot")

    def kv_usage(self) -> float:
        return 1.0 - self.pages.num_free / self.pages.num_usable

    def mamba_usage(self) -> float:
        used = (self.live.count - self.live.num_free) + (self.snapshots.count - self.snapshots.num_free)
        return used / max(1, self.live.count + self.snapshots.count)

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        self.live.check_integrity()
        self.snapshots.check_integrity()
