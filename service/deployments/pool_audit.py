"""Who holds the engine's KV pages and mamba slots: the prefix cache, or requests (for leak checks).

`audit_pools(engine)` runs between engine steps, where the engine lives (`inspect`). With no request in the engine,
every allocated page and snapshot slot must belong to the prefix cache, no live slot may be in use and
no cache node may be locked; anything else is a leak. The engine deployment returns it from
`stats(audit=True)` together with `check_integrity`'s verdict and the replica's resident memory.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from service.engine.engine import Engine


@dataclass(frozen=True)
class PoolAudit:
    requests_in_engine: int  # running + waiting
    kv_pages_in_use: int  # pages with a reference
    kv_page_refs_outside_cache: int  # references held by requests (all references minus the cache's)
    live_slots_in_use: int  # mamba state slots of running requests
    snapshot_slots_in_use: int
    snapshot_slots_outside_cache: int  # allocated snapshot slots no cache node owns (pending or leaked)
    locked_cache_nodes: int  # cache nodes a request still depends on (the root excluded)
    integrity_error: str | None  # Engine.check_integrity's failure, if any

    def leaks(self) -> list[str]:
        """What is held although no request is in the engine (empty: nothing leaked)."""
        if self.requests_in_engine:
            return [f"{self.requests_in_engine} requests still in the engine"]
        held = {
            "kv page references outside the cache": self.kv_page_refs_outside_cache,
            "live mamba slots": self.live_slots_in_use,
            "snapshot slots outside the cache": self.snapshot_slots_outside_cache,
            "locked cache nodes": self.locked_cache_nodes,
        }
        out = [f"{n} {what}" for what, n in held.items() if n]
        return out + ([f"check_integrity: {self.integrity_error}"] if self.integrity_error else [])


def audit_pools(engine: Engine) -> dict[str, Any]:
    """`PoolAudit` of `engine` as a dict. Call between steps only (through `inspect`)."""
    pools, tree = engine.cache.pools, engine.cache.tree
    try:
        engine.check_integrity()
        integrity_error = None
    except AssertionError as exc:
        integrity_error = str(exc) or "assertion failed"
    tree_pages = tree_slots = locked = 0
    if tree is not None:
        for node in tree._nodes():
            if node is tree.root:
                continue
            tree_pages += len(node.page_ids)
            tree_slots += node.snapshot_slot is not None
            locked += node.lock_ref > 0
    refcount = pools.pages.refcount
    all_refs = int(sum(int(r) for r in refcount))
    return asdict(
        PoolAudit(
            requests_in_engine=len(engine.scheduler.running) + len(engine.scheduler.waiting),
            kv_pages_in_use=sum(1 for r in refcount if r > 0),
            kv_page_refs_outside_cache=all_refs - tree_pages,
            live_slots_in_use=len(pools.live.in_use),
            snapshot_slots_in_use=len(pools.snapshots.in_use),
            snapshot_slots_outside_cache=len(pools.snapshots.in_use) - tree_slots,
            locked_cache_nodes=locked,
            integrity_error=integrity_error,
        )
    )


def resident_memory_bytes() -> int:
    """This process' resident set size (Linux /proc)."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
