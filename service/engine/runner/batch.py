"""ForwardBatch: the flat tensors of one step, built from its StepPlan without per-token loops."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch

from service.engine.distributed.step import StepPlan, StepRow
from service.engine.kernels.ssd import build_chunk_layout, snapshot_chunk_indices
from service.engine.kernels.transfer import host_to_device, to_device_async
from service.engine.layers.meta import AttentionMeta, MambaMeta, MambaSplit, SnapshotPlan


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64 token ids of all the plan's tokens, request-major
    attn: AttentionMeta
    mamba: MambaMeta
    logits_indices: torch.Tensor  # [R] int64 flat index of the last token of each sampling request
    sample_rows: tuple[int, ...]  # R batch indices (into plan.rows) whose next token is sampled


def scheduled_token_ids(plan: StepPlan) -> np.ndarray:
    """[T] int64 token ids of all of the plan's tokens, request-major (its rows' token_ids in batch order)."""
    return np.fromiter(
        itertools.chain.from_iterable(r.token_ids for r in plan.rows), dtype=np.int64, count=plan.num_tokens
    )


def build_forward_batch(
    plan: StepPlan,
    page_size: int,
    chunk_size: int,
    device: torch.device | str,
    input_ids: torch.Tensor | None = None,
    split_mamba: bool = False,
) -> ForwardBatch:
    """input_ids: [T] int64 on the device, the step's tokens when they are not on the host yet (None: the rows'
    token_ids). split_mamba: a step that mixes one-token rows with longer ones gets `MambaMeta.split` (the kernel
    bundle's `mamba_decode_split`)."""
    reqs = plan.rows
    B = len(reqs)
    qlens = np.array([s.num_new_tokens for s in reqs], dtype=np.int64)
    plens = np.array([s.prefix_len for s in reqs], dtype=np.int64)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    T = int(qsl[-1])
    token_req = np.repeat(np.arange(B), qlens)
    positions = plens[token_req] + (np.arange(T) - qsl[token_req])
    max_pages = max(len(s.page_ids) for s in reqs)
    page_table = np.zeros((B, max_pages), dtype=np.int64)
    for i, s in enumerate(reqs):
        page_table[i, : len(s.page_ids)] = s.page_ids
    slot_mapping = page_table[token_req, positions // page_size] * page_size + positions % page_size
    sample_rows = tuple(i for i, s in enumerate(reqs) if s.sample)
    logits_idx = qsl[1:][list(sample_rows)] - 1

    def dev(a: np.ndarray) -> torch.Tensor:
        return host_to_device(torch.from_numpy(np.ascontiguousarray(a)), device)

    qsl_dev = dev(qsl)
    attn = AttentionMeta(
        dev(slot_mapping), dev(page_table), qsl_dev, dev(plens), int(qlens.max()), int((plens + qlens).max()), page_size
    )
    mamba = _mamba_meta(reqs, chunk_size, device, qsl_dev)
    one = qlens == 1
    if split_mamba and one.any() and not one.all():
        dec, pre = np.flatnonzero(one), np.flatnonzero(~one)
        mamba = replace(
            mamba,
            split=MambaSplit(
                decode_tokens=dev(qsl[dec]),
                decode=_mamba_meta(tuple(reqs[i] for i in dec), chunk_size, device),
                prefill_tokens=dev(np.flatnonzero(~one[token_req])),
                prefill=_mamba_meta(tuple(reqs[i] for i in pre), chunk_size, device),
            ),
        )
    ids = dev(scheduled_token_ids(plan)) if input_ids is None else input_ids
    return ForwardBatch(ids, attn, mamba, dev(logits_idx), sample_rows)


def _mamba_meta(
    rows: tuple[StepRow, ...], chunk_size: int, device: torch.device | str, qsl_dev: torch.Tensor | None = None
) -> MambaMeta:
    """The mamba layers' metadata of rows (batch order) run as one batch; qsl_dev: their query_start_loc on the
    device when it is built already."""
    qlens = np.array([s.num_new_tokens for s in rows], dtype=np.int64)
    qsl = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])

    def dev(a: np.ndarray) -> torch.Tensor:
        return host_to_device(torch.from_numpy(a), device)

    decode_only = bool((qlens == 1).all())
    plens = [s.prefix_len for s in rows]
    layout = None if decode_only else build_chunk_layout(qlens.tolist(), plens, chunk_size, device)
    return MambaMeta(
        slot_ids=dev(np.array([s.live_slot for s in rows], dtype=np.int64)),
        query_start_loc=dev(qsl) if qsl_dev is None else qsl_dev,
        token_req=dev(np.repeat(np.arange(len(rows)), qlens)),
        decode_only=decode_only,
        layout=layout,
        snapshots=_snapshot_plan(rows, layout, device),
    )


def _snapshot_plan(rows: tuple[StepRow, ...], layout, device: torch.device) -> SnapshotPlan:
    req_idx, num_new, positions, dests = [], [], [], []
    plens = [s.prefix_len for s in rows]
    for i, s in enumerate(rows):
        for pt in s.snapshots:
            req_idx.append(i)
            num_new.append(pt.position - s.prefix_len)
            positions.append(pt.position)
            dests.append(pt.slot_id)
    chunk_idx = (
        snapshot_chunk_indices(layout, req_idx, positions, plens)
        if (layout is not None and req_idx)
        else [0] * len(req_idx)
    )

    def t(x: list[int]) -> torch.Tensor:
        return to_device_async(x, torch.int64, device)

    return SnapshotPlan(t(req_idx), t(num_new), t(chunk_idx), t(dests))
