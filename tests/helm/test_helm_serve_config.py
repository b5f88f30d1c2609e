"""serveConfigV2 is a valid Ray Serve config whose app arguments are the app's own AppArgs.

Oracles: ray.serve.schema.ServeDeploySchema (Ray's schema, as KubeRay submits the config to Ray),
Ray's own import utility, and service.deployments.args.AppArgs."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from service.deployments.args import AppArgs
from tests.helm.helm_chart_util import CONFIGS, REPO, load_values, only, pod_templates

IMPORT_PATH = "service.deployments.app:build_app"


def serve_config(objects: list[dict]) -> dict:
    return yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])


@pytest.mark.parametrize("config", CONFIGS)
def test_serve_config_passes_rays_schema(manifests, config):
    raw = serve_config(manifests(config))
    # ServeDeploySchema tolerates unknown keys for forward compatibility; a typo would pass silently.
    assert set(raw) <= set(ServeDeploySchema.model_fields), set(raw) - set(ServeDeploySchema.model_fields)
    for app in raw["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields)
    schema = ServeDeploySchema.model_validate(raw)
    assert [app.import_path for app in schema.applications] == [IMPORT_PATH]


def test_rays_schema_rejects_a_broken_config(manifests):
    """The oracle is live: two applications on the same route prefix are refused."""
    raw = serve_config(manifests("default"))
    twin = {**raw["applications"][0], "name": "twin"}
    with pytest.raises(ValueError, match="route_prefix"):
        ServeDeploySchema.model_validate({**raw, "applications": [raw["applications"][0], twin]})


@pytest.mark.parametrize("config", CONFIGS)
def test_app_args_validate_and_carry_the_values(manifests, config):
    objects = manifests(config)
    raw = serve_config(objects)
    args = AppArgs.model_validate(raw["applications"][0]["args"])
    values = load_values(config)
    engine = values["engine"]
    assert args.model_path == values["model"]["path"]
    assert (args.tp, args.ep, args.replicas, args.page_size) == (
        engine["tp"],
        engine["ep"],
        engine["replicas"],
        engine["pageSize"],
    )
    assert (args.mamba_cache_strategy, args.device, args.kernel_backend) == (
        engine["mambaCacheStrategy"],
        engine["device"],
        engine["kernelBackend"],
    )
    assert args.reasoning_parser == (engine["reasoningParser"] or None)
    assert args.tool_call_parser == (engine["toolCallParser"] or None)
    assert args.served_model_name == (values["model"]["servedModelName"] or None)
    assert args.router.kind == values["router"]["kind"] and args.router.w_prefix == values["router"]["wPrefix"]
    assert args.canary.enabled == values["canary"]["enabled"]
    assert args.canary.interval_s == values["canary"]["intervalSeconds"]
    if engine["autoscaling"]["enabled"]:
        assert (args.min_replicas, args.max_replicas) == (
            engine["autoscaling"]["minReplicas"],
            engine["autoscaling"]["maxReplicas"],
        )
    else:
        assert args.min_replicas is None and args.max_replicas is None
    # The Serve proxy listens where the pods expose the port named "serve".
    worker = pod_templates(only(objects, "RayService"))["worker"]["spec"]["containers"][0]
    assert raw["http_options"]["port"] == {p["name"]: p["containerPort"] for p in worker["ports"]}["serve"]
    assert raw["applications"][0]["route_prefix"] == args.route_prefix


def test_import_path_imports_build_app():
    """Imported the way Ray Serve imports it. Fails until service/deployments/app.py lands."""
    module = importlib.import_module("service.deployments.app")
    build_app = import_attr(IMPORT_PATH)
    assert build_app is module.build_app and callable(build_app)
    params = list(inspect.signature(build_app).parameters)
    assert len(params) == 1, f"build_app takes exactly the args dict, has {params}"


def cpu_quantity(value: str) -> float:
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def place(replica_bundles: list[list[dict]], strict_pack: bool, pods: list[dict[str, float]]) -> bool:
    """First-fit placement of each replica's placement-group bundles on worker pods (Ray logical
    resources = the pod's limits); STRICT_PACK keeps a replica's bundles on one pod."""

    def fits(pod: dict[str, float], need: dict[str, float]) -> bool:
        return all(pod.get(k, 0.0) >= v for k, v in need.items())

    def take(pod: dict[str, float], need: dict[str, float]) -> None:
        for k, v in need.items():
            pod[k] -= v

    for bundles in replica_bundles:
        units = [{k: sum(b.get(k, 0) for b in bundles) for k in ("CPU", "GPU")}] if strict_pack else bundles
        for unit in units:
            pod = next((p for p in pods if fits(p, unit)), None)
            if pod is None:
                return False
            take(pod, unit)
    return True


@pytest.mark.parametrize("config", CONFIGS)
def test_worker_pods_can_host_the_apps_replicas(manifests, config):
    """The engine deployment's own Ray options (app.engine_deployment_options) fit the rendered pods."""
    from service.deployments.app import engine_deployment_options

    rayservice = only(manifests(config), "RayService")
    args = AppArgs.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"])
    options = engine_deployment_options(args)
    actor = options["ray_actor_options"]
    bundles = options.get("placement_group_bundles") or [
        {"CPU": actor.get("num_cpus", 1), "GPU": actor.get("num_gpus", 0)}
    ]
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    pods = [
        {"CPU": cpu_quantity(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0))}
        for _ in range(group["minReplicas"])
    ]
    replicas = args.min_replicas or args.replicas
    strict = options.get("placement_group_strategy", "STRICT_PACK") == "STRICT_PACK"
    assert place([bundles] * replicas, strict, pods), (
        f"{replicas} x {bundles} ({'STRICT_PACK' if strict else 'PACK'}) do not fit {group['minReplicas']} pod(s) of {limits}"
    )


@pytest.mark.parametrize(
    "config,released_config",
    [
        ("default", "nano_30b_a3b_config.json"),
        ("nano-1gpu", "nano_30b_a3b_config.json"),
        ("two-replicas-router", "nano_30b_a3b_config.json"),
        ("super-tp4-ep4", "super_120b_a12b_config.json"),
    ],
)
def test_examples_state_the_real_models_mamba_groups(config, released_config):
    """model.mambaGroups is n_groups of the released model's config.json, and tp divides it."""
    hf_config = json.loads((REPO / "tests" / "engine" / "fixtures" / released_config).read_text())
    values = load_values(config)
    assert values["model"]["mambaGroups"] == hf_config["n_groups"]
    assert hf_config["n_groups"] % values["engine"]["tp"] == 0
    assert hf_config["mamba_num_heads"] % values["engine"]["tp"] == 0
