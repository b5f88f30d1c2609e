"""A mixed step's mamba layer run in two parts (`MambaMeta.split`: one-token rows by the decode recurrence, the
others by the varlen conv and scan) equals the one varlen pass over every row: each token's output, every live
slot's conv and SSM state and every snapshot slot, fp32. The oracle is the one-pass path (itself compared with
transformers in test_parity.py); both run the same layer on the same inputs and pool contents."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.distributed.step import SnapshotPoint, StepPlan, StepRow
from service.engine.runner.batch import build_forward_batch

PAGE = 4

# a row: (prefix_len, new tokens, snapshot positions); the tiny model's chunk size is 16, so a snapshot position is a
# multiple of 16 in (prefix_len, prefix_len + new tokens], one-token rows included
DECODES = [(23, 1, ()), (5, 1, ()), (40, 1, ()), (31, 1, (32,)), (9, 1, ())]
MIXES = {
    "decodes only": DECODES,
    "prefills only": [(0, 37, (16, 32)), (0, 3, ()), (0, 64, ())],
    "decodes + one prefill": [*DECODES[:3], (0, 64, (16, 48)), *DECODES[3:]],
    "decodes + unaligned prefills": [(0, 21, (16,)), *DECODES[:2], (0, 2, ()), DECODES[2], (0, 45, (32,)), DECODES[3]],
    "decodes + a prefill after a cached prefix": [*DECODES[:2], (32, 29, (48,)), DECODES[2], (21, 11, (32,))],
    "one decode + a one-token prompt + a prefill": [(0, 1, ()), (7, 1, ()), (3, 14, (16,))],
}


@pytest.fixture(scope="module", params=["native", "torch"])
def engine(request, tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model_path=tiny_model_dir,
            device="cpu",
            dtype="float32",
            kernel_backend=request.param,
            page_size=PAGE,
            max_num_seqs=8,
            max_mamba_snapshots=16,
        )
    )


def _plan(rows: list[tuple[int, int, tuple[int, ...]]], snapshot_slots: list[int]) -> StepPlan:
    """Rows on live slots 1.. (shuffled), pages 1.., snapshot slots taken from snapshot_slots in order."""
    g = torch.Generator().manual_seed(len(rows))
    live = (torch.randperm(len(rows), generator=g) + 1).tolist()
    out, page, free = [], 1, iter(snapshot_slots)
    for i, (p, n, snaps) in enumerate(rows):
        pages = -(-(p + n) // PAGE)
        out.append(
            StepRow(
                f"r{i}",
                p,
                n,
                live[i],
                tuple(range(page, page + pages)),
                tuple(range(3, 3 + n)),
                tuple(SnapshotPoint(s, next(free)) for s in snaps),
                SamplingParams(),
            )
        )
        page += pages
    return StepPlan(tuple(out))


def _run(engine: Engine, plan: StepPlan, split: bool, h: torch.Tensor, pools: tuple[torch.Tensor, torch.Tensor]):
    """The first mamba layer on h [T, hidden] with copies of pools (conv, ssm of that layer): (out, conv, ssm)."""
    model, cfg = engine.runner.model, engine.config
    batch = build_forward_batch(plan, cfg.page_size, engine.model_config.chunk_size, "cpu", split_mamba=split)
    lens = {r.num_new_tokens == 1 for r in plan.rows}
    assert (batch.mamba.split is not None) == (split and lens == {True, False})  # split when the rows mix
    lid = next(i for i in range(len(model.backbone.layers)) if i in model.mamba_pool_index)
    conv, ssm = (p.clone() for p in pools)
    k = dataclasses.replace(model.kernels, mamba_decode_split=split)
    with torch.inference_mode():
        out = model.backbone.layers[lid].mixer(h, batch.mamba, conv, ssm, k)
    return out, conv, ssm


@pytest.mark.parametrize("mix", list(MIXES))
def test_split_equals_one_varlen_pass(engine, mix):
    rows = MIXES[mix]
    conv_pool, ssm_pool = engine.runner.pools.conv[0], engine.runner.pools.ssm[0]
    snapshot_slots = list(range(len(rows) + 1, conv_pool.shape[0]))
    plan = _plan(rows, snapshot_slots)
    g = torch.Generator().manual_seed(7)
    # live states as a request that has run holds them; a row of prefix 0 starts from a zeroed slot
    conv = torch.randn(conv_pool.shape, generator=g)
    ssm = torch.randn(ssm_pool.shape, generator=g) * 0.3
    for r in plan.rows:
        if r.prefix_len == 0:
            conv[r.live_slot] = 0
            ssm[r.live_slot] = 0
    h = torch.randn(plan.num_tokens, engine.model_config.hidden_size, generator=g)
    one_out, one_conv, one_ssm = _run(engine, plan, False, h, (conv, ssm))
    split_out, split_conv, split_ssm = _run(engine, plan, True, h, (conv, ssm))
    torch.testing.assert_close(split_out, one_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split_conv, one_conv, rtol=0, atol=0)  # raw inputs, copied
    torch.testing.assert_close(split_ssm, one_ssm, rtol=1e-5, atol=1e-5)
    touched = [r.live_slot for r in plan.rows] + [s.slot_id for r in plan.rows for s in r.snapshots]
    assert not torch.equal(one_ssm[touched], ssm[touched])  # the step did move the states it compares
