"""GPUs of a tensor-parallel engine replica under Ray: the replica actor holds bundle 0 of its placement group
(app.replica_placement); its rank processes are its children and use the GPUs reserved by bundles 1..tp-1."""

from __future__ import annotations

import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=0, num_gpus=1)
def _bundle_gpu_ids() -> list[str]:
    return [str(i) for i in ray.get_gpu_ids()]


def expose_rank_gpus(tp: int) -> str:
    """Sets CUDA_VISIBLE_DEVICES of this replica process (and so of the rank processes it spawns) to its own GPU
    followed by the GPU of each other bundle, so rank r runs on cuda:r. Call before CUDA is initialised here.
    Returns the value set."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError(
            f"tp={tp} needs the replica to run in a placement group of {tp} GPU bundles (app.engine_deployment_options)"
        )
    own = [str(i) for i in ray.get_gpu_ids()]
    if len(own) != 1:
        raise RuntimeError(f"the replica actor should hold one GPU (bundle 0), it holds {own}")
    others = ray.get(
        [
            _bundle_gpu_ids.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            ).remote()
            for i in range(1, tp)
        ]
    )
    ids = own + [g[0] for g in others]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    return os.environ["CUDA_VISIBLE_DEVICES"]
