"""Data parallelism over CPU processes for `train-tiny-model --workers N`.

Every worker holds the whole model and takes a contiguous share of each step's rows. A step's loss is the mean
over the label tokens of the whole batch, as with one worker: each worker sums its rows' token losses and divides
by the batch's token count (summed over the workers before the forward pass); the gradients are then summed over
the workers (one gloo all-reduce over 127.0.0.1), so every worker applies the same update and the copies stay
identical. Worker 0 logs, checkpoints, measures and writes the folder; the others only train.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# gloo binds where this interface points: the workers of one machine talk over loopback only
_LOOPBACK_INTERFACE = "lo"


@dataclass(frozen=True)
class Shard:
    rank: int = 0  # this worker's index; worker 0 logs, checkpoints and writes the folder
    world: int = 1  # workers in all (1: no process group, nothing is exchanged)

    def rows(self, batch_size: int) -> slice:
        """This worker's rows of a step of `batch_size` rows (a contiguous, equal share)."""
        if batch_size % self.world:
            raise ValueError(f"--batch-size {batch_size} must be a multiple of --workers {self.world}")
        share = batch_size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum_counts(self, values: list[int]) -> list[int]:
        """Each value summed over the workers (a stop request, the step's label tokens, ...)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t)
        return [int(v) for v in t]

    def sum_grads(self, model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
        """Sum every parameter's gradient and the (detached) loss over the workers, in place; returns the sum."""
        if self.world == 1:
            return loss.detach()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        return flat[-1].clone()  # a copy: a view would keep the whole summed buffer alive with the loss


def start_group(rank: int, world: int, store: Any) -> Shard:
    """Join the gloo group of `world` workers through `store` (worker 0 created it); returns this worker's shard."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _LOOPBACK_INTERFACE)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    return Shard(rank, world)


def host_store(world: int) -> Any:
    """Worker 0's rendezvous store on 127.0.0.1 (a free port, picked by the OS)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(minutes=2), wait_for_workers=False)


def join_store(port: int, world: int) -> Any:
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(minutes=2))


def stop_group(shard: Shard) -> None:
    if shard.world > 1:
        dist.destroy_process_group()


def shard_rows(items: Any, shard: Shard) -> Any:
    """`items` cut to this worker's rows (None stays None)."""
    return None if items is None else items[shard.rows(len(items))]
