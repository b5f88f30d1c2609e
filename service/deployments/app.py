"""`build_app(args)`: the Ray Serve application (docs/design.md: Serving) — an OpenAI ingress deployment in front of
N engine replicas, routed by the prefix-aware `RequestRouter` (or Serve's default router).

Used by `hybrid-serve serve`, by tests (`serve.run(build_app({...}))`) and by the Helm chart's
`serveConfigV2` (`import_path: service.deployments.app:build_app`, `args:` = `AppArgs`).
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from service.deployments.args import QUEUED_REQUESTS_PER_REPLICA, AppArgs
from service.deployments.engine_deployment import EngineDeployment
from service.deployments.ingress import OpenAIIngress

ROUTER_CLASS_PATH = "service.deployments.router.PrefixAwareRouter"
ROUTING_STATS_PERIOD_S = 2.0  # how often replicas report their cached prefixes to the router
ROUTING_REPORT_GRACE_S = 3 * ROUTING_STATS_PERIOD_S + 5.0  # dispatches younger than this outlive a report
ENGINE_GRACEFUL_SHUTDOWN_S = 60.0  # drain: how long Serve waits for in-flight requests on shutdown
RANK_BUNDLE_CPUS = 0.01  # CPU share of a rank bundle on CPU-only clusters (accounting only)


def request_router_config(args: AppArgs) -> RequestRouterConfig:
    """Router choice and knobs for the engine deployment."""
    if args.router.kind == "default":
        return RequestRouterConfig(request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    kwargs = {
        "w_prefix": args.router.w_prefix,
        "w_load": args.router.w_load,
        "max_load_imbalance": args.router.max_load_imbalance,
        "index_capacity_blocks": args.router.index_capacity_blocks,
        "report_grace_s": ROUTING_REPORT_GRACE_S,
        "default_block_size_tokens": args.page_size,
    }
    return RequestRouterConfig(
        request_router_class=ROUTER_CLASS_PATH,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )


def engine_deployment_options(args: AppArgs) -> dict[str, Any]:
    """`serve.deployment` options: replicas or autoscaling, resources, routing, drain."""
    options: dict[str, Any] = {
        "name": "engine",
        "max_ongoing_requests": args.max_ongoing_requests,
        "max_queued_requests": QUEUED_REQUESTS_PER_REPLICA
        * args.max_ongoing_requests
        * (args.max_replicas or args.replicas),
        "request_router_config": request_router_config(args),
        "graceful_shutdown_timeout_s": ENGINE_GRACEFUL_SHUTDOWN_S,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "logging_config": {"enable_access_log": args.access_log},
    }
    if args.min_replicas is not None or args.max_replicas is not None:
        lo = args.min_replicas or 1
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": args.max_replicas or max(lo, args.replicas),
            "initial_replicas": max(lo, args.replicas),
            "target_ongoing_requests": args.target_ongoing_requests,
        }
    else:
        options["num_replicas"] = args.replicas
    options.update(replica_placement(args))
    return options


def ingress_deployment_options(args: AppArgs) -> dict[str, Any]:
    """The OpenAI ingress: it admits twice what the engine deployment can run or queue (Serve's default of 5
    ongoing requests per replica would hold the rest in the proxy), so that beyond the engine's bound requests get
    503 (from the handle's queue bound, or the engine replica's bound on grouped requests) instead of waiting in
    the proxy."""
    engine_replicas = args.max_replicas or args.replicas
    admitted = 2 * (1 + QUEUED_REQUESTS_PER_REPLICA) * args.max_ongoing_requests * engine_replicas
    return {
        "name": "openai",
        "num_replicas": args.ingress_replicas,
        "max_ongoing_requests": -(-admitted // args.ingress_replicas),
        "ray_actor_options": {"num_cpus": 0.1},
        "graceful_shutdown_timeout_s": ENGINE_GRACEFUL_SHUTDOWN_S,
        "graceful_shutdown_wait_loop_s": 1.0,
        "logging_config": {"enable_access_log": args.access_log},
    }


def replica_placement(args: AppArgs) -> dict[str, Any]:
    """Resources of one engine replica. tp > 1: one placement-group bundle per rank, all on one node
    (STRICT_PACK); the replica actor (rank 0's process is its child) takes bundle 0, the other ranks' processes
    use the GPUs of bundles 1..tp-1. On CPU the rank bundles hold a token CPU share (Ray refuses empty bundles):
    the rank processes are the replica's children, not Ray tasks."""
    gpu = args.gpus_per_replica > 0
    actor = {"num_cpus": args.cpus_per_replica, "num_gpus": 1 if gpu else 0}
    if args.tp == 1:
        return {"ray_actor_options": actor}
    first = {"CPU": args.cpus_per_replica, "GPU": 1} if gpu else {"CPU": args.cpus_per_replica}
    rank = {"GPU": 1} if gpu else {"CPU": RANK_BUNDLE_CPUS}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": [first] + [dict(rank) for _ in range(args.tp - 1)],
        "placement_group_strategy": "STRICT_PACK",
    }


def resolve_device(args: AppArgs) -> AppArgs:
    """device="auto" becomes "cuda" when the Ray cluster has GPUs, else "cpu" (so CPU-only clusters never
    ask for GPU resources)."""
    if args.device != "auto":
        return args
    if ray.is_initialized():
        has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    else:
        import torch  # noqa: PLC0415  (only when there is no cluster to ask)

        has_gpu = torch.cuda.is_available()
    return args.model_copy(update={"device": "cuda" if has_gpu else "cpu"})


def build_app(args: dict[str, Any]) -> serve.Application:
    """Validate `args` with `AppArgs` and bind the ingress to the engine deployment."""
    app_args = resolve_device(AppArgs.model_validate(args))
    args_dict = app_args.model_dump(mode="json")
    engine = serve.deployment(EngineDeployment).options(**engine_deployment_options(app_args)).bind(args_dict)
    ingress = serve.deployment(OpenAIIngress).options(**ingress_deployment_options(app_args)).bind(engine, args_dict)
    return ingress
