"""The step message: everything a rank needs to run one engine step, as plain picklable values.

The scheduler (one, on the engine's side) turns its decisions into a `StepPlan`; every tensor-parallel rank
receives the same plan and carries out the device work it lists: slot copies and zero fills, the forward, the
snapshot copies taken during the forward, and (rank 0 only) sampling. No `Request` object crosses: a row names
its request by id and lists the ids (pages, slots), positions and tokens it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.request import SamplingParams


@dataclass(frozen=True)
class SnapshotPoint:
    position: int  # absolute token position s: the snapshot holds the state after tokens [0, s)
    slot_id: int  # snapshot slot filled during the forward


@dataclass(frozen=True)
class StepRow:
    """One request's part of a step (its tokens are fed at positions [prefix_len, prefix_len + num_new_tokens))."""

    request_id: str  # names the row's seeded generator (sampling rank) and, carried, its input token
    prefix_len: int  # p: tokens already in the request's KV pages and live slot
    num_new_tokens: int  # l: tokens fed this step
    live_slot: int  # mamba slot holding the request's live state
    page_ids: tuple[int, ...]  # KV pages covering positions [0, p + l), in order
    token_ids: tuple[int, ...]  # the l tokens fed; () when carried
    snapshots: tuple[SnapshotPoint, ...]  # states to copy into snapshot slots during the forward
    params: SamplingParams | None  # set iff the row samples (its chunk ends at the last known token)
    carried: bool = False  # l == 1 and the token fed is the request's sample of the previous launched step, read
    #                        on the device (the host does not know it yet)

    @property
    def sample(self) -> bool:
        return self.params is not None


@dataclass(frozen=True)
class StepPlan:
    """One step for every rank. Order of device work: publish copies, slot copies, slot zeros, forward, sample."""

    rows: tuple[StepRow, ...]  # in batch order
    slot_copies: tuple[tuple[int, int], ...] = ()  # (src snapshot slot, dst live slot): cache hits, before the forward
    slot_zeros: tuple[int, ...] = ()  # fresh live slots to zero before the forward
    publish_copies: tuple[tuple[int, int], ...] = ()  # (src live slot, dst snapshot slot): states published since
    #                                                   the previous plan, copied first (a slot may be reused here)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def carried(self) -> bool:
        """Whether a row's input token is a sample of the previous launched step (the plan must be launched)."""
        return any(r.carried for r in self.rows)


@dataclass(frozen=True)
class SlotOps:
    """Device work between steps, in this order: publish copies, then dropping finished requests' generators."""

    publish_copies: tuple[tuple[int, int], ...] = ()  # (src live slot, dst snapshot slot)
    released: tuple[str, ...] = ()  # request ids whose seeded generators are dropped

    def __bool__(self) -> bool:
        return bool(self.publish_copies or self.released)


@dataclass(frozen=True)
class LaunchLimits:
    """What a rank's decode graphs replay (plain decode rows; the other rows of a step run eagerly)."""

    max_batch: int  # rows at most
    max_pages: int  # pages per row at most (the static page table's width)


def is_plain_decode(row: StepRow, max_pages: int) -> bool:
    """One new token, sampled, no snapshot this step, and a page list that fits the static page table."""
    return row.num_new_tokens == 1 and row.params is not None and not row.snapshots and len(row.page_ids) <= max_pages


def is_launchable(plan: StepPlan, limits: LaunchLimits) -> bool:
    """Plain decode rows only, and at most limits.max_batch of them."""
    return 0 < len(plan.rows) <= limits.max_batch and all(is_plain_decode(r, limits.max_pages) for r in plan.rows)


def sub_plan(plan: StepPlan, rows: tuple[int, ...]) -> StepPlan:
    """The step restricted to `rows` (batch order kept). Slot work is left out: the caller applies it once, before
    any part runs."""
    if len(rows) == len(plan.rows) and not (plan.slot_copies or plan.slot_zeros or plan.publish_copies):
        return plan
    return StepPlan(tuple(plan.rows[i] for i in rows))
