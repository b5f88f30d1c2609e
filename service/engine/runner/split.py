"""Splitting one scheduled step into its plain decode rows and the rest (docs/design.md: Scheduler and runner).

A step that mixes prefill chunks with decodes cannot be replayed from a CUDA graph as a whole (the varlen SSD
layout depends on the prefill lengths), but its plain decode rows can: requests are independent (own KV pages,
own mamba slot), so running the decode rows through a captured graph and the rest through one eager forward, in
the same step, computes the same thing as one mixed forward. Slot copies and zeroing happen before both.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.engine.distributed.step import StepPlan, is_plain_decode


@dataclass(frozen=True)
class StepSplit:
    graph_rows: tuple[int, ...]  # indices into plan.rows of plain decode rows (1 token, sampled, no snapshot)
    eager_rows: tuple[int, ...]  # indices into plan.rows of every other row, in batch order


def split_step(plan: StepPlan, max_batch: int, max_pages: int) -> StepSplit:
    """Partition the step: at most `max_batch` plain decode rows (the first ones in batch order) go to the graph
    part, every other row to the eager part. Both keep batch order."""
    graph: list[int] = []
    eager: list[int] = []
    for i, s in enumerate(plan.rows):
        if len(graph) < max_batch and is_plain_decode(s, max_pages):
            graph.append(i)
        else:
            eager.append(i)
    return StepSplit(tuple(graph), tuple(eager))


def restore_batch_order(values: list, rows: list[int]) -> list:
    """`values[k]` belongs to scheduled row `rows[k]`; returns the values sorted by their row (batch order)."""
    if all(rows[k] < rows[k + 1] for k in range(len(rows) - 1)):
        return values
    return [values[k] for k in sorted(range(len(rows)), key=rows.__getitem__)]
