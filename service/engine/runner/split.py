"""Splitting one scheduled step into its plain decode rows and the rest (docs/design.md: Scheduler and runner).

A step that mixes prefill chunks with decodes cannot be replayed from a CUDA graph as a whole (the varlen SSD
layout depends on the prefill lengths), but its plain decode rows can: requests are independent (own KV pages,
own mamba slot), so running the decode rows through a captured graph and the rest through one eager forward, in
the same step, computes the same thing as one mixed forward. Slot copies and zeroing happen before both.
"""
from __future__ import annotations

from dataclasses import dataclass

from service.engine.scheduler.scheduler import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class StepSplit:
    graph_rows: tuple[int, ...]   # indices into sched.scheduled of plain decode rows (1 token, sampled, no snapshot)
    eager_rows: tuple[int, ...]   # indices into sched.scheduled of every other row, in batch order


def is_plain_decode(s: ScheduledRequest, max_pages: int) -> bool:
    """One new token, sampled, no snapshot this step, and a page list that fits the static page table."""
    return s.num_new_tokens == 1 and s.sample and not s.snapshots and len(s.request.page_ids) <= max_pages


def split_step(sched: SchedulerOutput, max_batch: int, max_pages: int) -> StepSplit:
    """Partition the step: at most `max_batch` plain decode rows (the first ones in batch order) go to the graph
    part, every other row to the eager part. Both keep batch order."""
    graph: list[int] = []
    eager: list[int] = []
    for i, s in enumerate(sched.scheduled):
        if len(graph) < max_batch and is_plain_decode(s, max_pages):
            graph.append(i)
        else:
            eager.append(i)
    return StepSplit(tuple(graph), tuple(eager))


def sub_schedule(sched: SchedulerOutput, rows: tuple[int, ...]) -> SchedulerOutput:
    """The step restricted to `rows` (batch order kept). Slot copies/zeros are left out: the caller applies them
    once, before any part runs."""
    if len(rows) == len(sched.scheduled):
        return sched
    return SchedulerOutput(tuple(sched.scheduled[i] for i in rows), (), (), ())


def restore_batch_order(values: list, rows: list[int]) -> list:
    """`values[k]` belongs to scheduled row `rows[k]`; returns the values sorted by their row (batch order)."""
    if all(rows[k] < rows[k + 1] for k in range(len(rows) - 1)):
        return values
    return [values[k] for k in sorted(range(len(rows)), key=rows.__getitem__)]
