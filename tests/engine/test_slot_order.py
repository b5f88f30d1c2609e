"""Mamba slot allocation order: the lowest free slot first, so a batch admitted together holds one ascending run
(the torch bundle then updates its decode states in place on a view of the pool)."""

from __future__ import annotations

import torch

from service.engine.cache.pools import SlotAllocator
from service.engine.kernels.cpu_ssd import ascending_run


def test_lowest_free_slot_first_after_frees_in_any_order():
    slots = SlotAllocator(1, 6, "live")
    first = [slots.alloc() for _ in range(4)]
    assert first == [1, 2, 3, 4]
    for s in (1, 3, 2, 4):  # freed in another order than allocated
        slots.free(s)
    again = [slots.alloc() for _ in range(4)]
    assert again == [1, 2, 3, 4] and ascending_run(torch.tensor(again)) == 1
    slots.free(2)
    assert slots.alloc() == 2
    slots.check_integrity()
