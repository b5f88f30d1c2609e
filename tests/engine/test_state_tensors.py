"""StateTensors' slot operations: zeroing and copying slots leaves the other slots alone, and on CUDA neither waits for
the device (a step that admits requests queues behind the step in flight; async scheduling keeps its overlap)."""

from __future__ import annotations

import pytest
import torch

from service.engine.cache.pools import PoolSizes
from service.engine.runner.state_tensors import StateShapes, StateTensors

SHAPES = StateShapes(
    num_attn_layers=1, kv_heads=1, head_dim=8, num_mamba_layers=2, conv_dim=6, conv_width=4,
    mamba_heads=2, mamba_head_dim=4, state_size=8,
)  # fmt: skip
SIZES = PoolSizes(num_kv_pages=4, num_live_slots=4, num_snapshot_slots=3)  # slots 0..7


def _filled(device: str) -> StateTensors:
    t = StateTensors(SIZES, 4, SHAPES, torch.float32, torch.device(device))
    for slot in range(SIZES.num_slots):
        t.conv[:, slot] = slot + 1
        t.ssm[:, slot] = 10 * (slot + 1)
    return t


def _check(t: StateTensors) -> None:
    t.copy_slots([5, 1], [6, 7])  # snapshot slot 5 -> 6, live slot 1 -> 7
    t.zero_slots([2, 3])
    expect = {0: 1, 1: 2, 2: 0, 3: 0, 4: 5, 5: 6, 6: 6, 7: 2}  # slot -> its conv value (ssm: 10x)
    for slot, value in expect.items():
        assert t.conv[:, slot].eq(value).all() and t.ssm[:, slot].eq(10 * value).all(), slot


def test_zero_and_copy_touch_only_their_slots():
    _check(_filled("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_zero_and_copy_do_not_wait_for_the_device():
    t = _filled("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a host-device synchronization raises
    try:
        t.copy_slots([5, 1], [6, 7])
        t.zero_slots([2, 3])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    t = _filled("cuda")
    _check(t)
