"""The chart lints, renders for the defaults and every example, and its objects are valid Kubernetes.

Oracles: the real `helm` binary (lint --strict, template) and kubernetes-validate's strict schemas
for the newest Kubernetes version it ships. CRD objects (RayService, PodMonitor, PrometheusRule,
HTTPRoute) have no core schema: their pod templates are validated as Pods and KubeRay's serve
Service spec as a Service."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from service.deployments.args import AppArgs
from tests.helm.helm_chart_util import CHART, CONFIGS, NAMESPACE, load_values, only, pod_templates, values_args

K8S_VERSION = latest_version()
CRD_KINDS = {"RayService", "PodMonitor", "PrometheusRule", "HTTPRoute"}
SHARED_KINDS = {
    "RayService",
    "PodMonitor",
    "PrometheusRule",
    "ConfigMap",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "Pod",
}


def validate_strict(obj: dict) -> None:
    """kubernetes-validate strict mode; raises with the failing path in the message."""
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def as_pod(template: dict, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template.get("metadata", {}), "name": name},
        "spec": template["spec"],
    }


def matches(selector: dict, labels: dict) -> bool:
    """Kubernetes matchLabels semantics (the chart uses no matchExpressions)."""
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def container(template: dict) -> dict:
    containers = template["spec"]["containers"]
    assert len(containers) == 1, "Ray pods run one container (KubeRay treats index 0 as the Ray container)"
    return containers[0]


@pytest.mark.parametrize("config", CONFIGS)
def test_helm_lint_strict(helm, config):
    result = helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values_args(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("config", CONFIGS)
def test_rendered_objects_pass_kubernetes_validate_strict(manifests, config):
    objects = manifests(config)
    kinds = {o["kind"] for o in objects}
    assert SHARED_KINDS <= kinds, f"missing {SHARED_KINDS - kinds}"
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    for obj in core:
        validate_strict(obj)
    rayservice = only(objects, "RayService")
    for role, tpl in pod_templates(rayservice).items():
        validate_strict(as_pod(tpl, f"{rayservice['metadata']['name']}-{role}"))
    serve_service = rayservice["spec"]["serveService"]
    validate_strict({"apiVersion": "v1", "kind": "Service", **serve_service})
    assert len(core) >= 4


def test_a_broken_object_is_rejected_by_the_validator(manifests):
    """The oracle is live: an unknown field in a rendered PDB fails strict validation."""
    pdb = only(manifests("default"), "PodDisruptionBudget")
    broken = {**pdb, "spec": {**pdb["spec"], "maxUnavailabel": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strict(broken)


@pytest.mark.parametrize("config", CONFIGS)
def test_gpu_sizing_matches_app_args(manifests, config):
    """Worker GPUs add up to replicas x AppArgs.gpus_per_replica; the head has none."""
    rayservice = only(manifests(config), "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    group = cluster["workerGroupSpecs"][0]
    args = AppArgs.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"])
    worker = container(group["template"])
    head = container(cluster["headGroupSpec"]["template"])
    gpus_per_pod = int(worker["resources"]["limits"].get("nvidia.com/gpu", 0))
    assert worker["resources"]["requests"] == worker["resources"]["limits"]
    min_replicas = args.min_replicas or args.replicas
    max_replicas = args.max_replicas or args.replicas
    assert group["minReplicas"] * gpus_per_pod == min_replicas * args.gpus_per_replica
    assert group["maxReplicas"] * gpus_per_pod == max_replicas * args.gpus_per_replica
    assert group["replicas"] == group["minReplicas"]
    assert gpus_per_pod <= load_values(config)["workers"]["maxGpusPerPod"]
    assert cluster["enableInTreeAutoscaling"] is (args.min_replicas is not None)
    # only the autoscaler sidecar needs a Kubernetes API token
    assert (
        cluster["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"]
        is cluster["enableInTreeAutoscaling"]
    )
    assert group["template"]["spec"]["automountServiceAccountToken"] is False
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    if args.gpus_per_replica:
        env = {e["name"] for e in worker["env"]}
        assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME"} <= env
        assert group["template"]["spec"]["tolerations"], "GPU workers tolerate the GPU taint"
    else:
        assert gpus_per_pod == 0 and not any(e["name"].startswith("NCCL_") for e in worker.get("env", []))


def test_super_tp4_ep4_is_one_four_gpu_pod_per_replica(manifests):
    """--tp 4 --ep 4 means 4 GPUs (the experts are spread over the same ranks), as in SGLang and vLLM."""
    rayservice = only(manifests("super-tp4-ep4"), "RayService")
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    args = AppArgs.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"])
    assert (args.tp, args.ep, args.gpus_per_replica) == (4, 4, 4)
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 1)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 4), (8, 1)])
def test_gpus_per_replica_is_tp(template, tp, ep):
    """engine.tp GPUs per replica whatever ep is; the Serve options ask for the same: one bundle per GPU."""
    from service.deployments.app import engine_deployment_options

    result = template("--set", f"engine.tp={tp}", "--set", f"engine.ep={ep}", "--set", "engine.replicas=3")
    assert result.returncode == 0, result.stderr
    rayservice = only(list(yaml.safe_load_all(result.stdout)), "RayService")
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert container(group["template"])["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    assert group["replicas"] == 3
    args = AppArgs.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"])
    options = engine_deployment_options(args)
    bundles = options.get("placement_group_bundles", [{"GPU": options["ray_actor_options"]["num_gpus"]}])
    assert sum(b.get("GPU", 0) for b in bundles) == tp and all(b.get("GPU") == 1 for b in bundles)
    assert tp == 1 or options["placement_group_strategy"] == "STRICT_PACK"


@pytest.mark.parametrize("config", CONFIGS)
def test_probes_are_kuberays_health_checks(manifests, config):
    """Same endpoints KubeRay injects: raylet (52365) and GCS (8265) on the head; raylet and the
    Serve proxy on workers, with readiness failing at once so traffic leaves an unready worker."""
    rayservice = only(manifests(config), "RayService")
    tpls = pod_templates(rayservice)
    head, worker = container(tpls["head"]), container(tpls["worker"])
    serve_port = {p["name"]: p["containerPort"] for p in worker["ports"]}["serve"]
    for c in (head, worker):
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["exec"]["command"][:2] == ["bash", "-c"]
    cmd = {
        (name, probe): c[probe]["exec"]["command"][2]
        for name, c in (("head", head), ("worker", worker))
        for probe in ("readinessProbe", "livenessProbe")
    }
    assert "localhost:52365/api/local_raylet_healthz" in cmd["head", "readinessProbe"]
    assert "localhost:8265/api/gcs_healthz" in cmd["head", "readinessProbe"]
    assert f"localhost:{serve_port}/-/healthz" in cmd["worker", "readinessProbe"]
    assert "-/healthz" not in cmd["worker", "livenessProbe"], "liveness must not kill a worker whose proxy is down"
    assert worker["readinessProbe"]["failureThreshold"] == 1
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["serve"] == serve_port


@pytest.mark.parametrize("config", CONFIGS)
def test_selectors_match_the_pods_they_are_for(manifests, config):
    objects = manifests(config)
    tpls = pod_templates(only(objects, "RayService"))
    head_labels, worker_labels = tpls["head"]["metadata"]["labels"], tpls["worker"]["metadata"]["labels"]
    pdb = only(objects, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"], worker_labels) and not matches(pdb["spec"]["selector"], head_labels)
    policy = only(objects, "NetworkPolicy")
    assert matches(policy["spec"]["podSelector"], head_labels) and matches(policy["spec"]["podSelector"], worker_labels)
    internal = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    test_pod = only(objects, "Pod")
    assert matches(internal, head_labels) and matches(internal, worker_labels)
    assert matches(internal, test_pod["metadata"]["labels"]), "the helm test pod must reach the OpenAI port"
    monitors = {pm["metadata"]["name"].rsplit("-", 1)[1]: pm for pm in objects if pm["kind"] == "PodMonitor"}
    assert set(monitors) == {"head", "worker"}
    for role, labels in (("head", head_labels), ("worker", worker_labels)):
        spec = monitors[role]["spec"]
        other = worker_labels if role == "head" else head_labels
        assert matches(spec["selector"], labels) and not matches(spec["selector"], other)
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        port_names = {p["name"] for p in container(tpls[role])["ports"]}
        assert {e["port"] for e in spec["podMetricsEndpoints"]} <= port_names


@pytest.mark.parametrize("config", CONFIGS)
def test_volumes_shm_and_weights(manifests, config):
    objects = manifests(config)
    values = load_values(config)
    for tpl in pod_templates(only(objects, "RayService")).values():
        volumes = {v["name"]: v for v in tpl["spec"]["volumes"]}
        mounts = {m["name"]: m for m in container(tpl)["volumeMounts"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"]["mountPath"] == "/dev/shm"
        if not values["weights"]["enabled"]:
            assert "weights" not in volumes
            continue
        claim = volumes["weights"]["persistentVolumeClaim"]
        assert claim["readOnly"] and mounts["weights"]["readOnly"]
        assert values["model"]["path"].startswith(mounts["weights"]["mountPath"] + "/")
        pvcs = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        if values["weights"]["existingClaim"]:
            assert claim["claimName"] == values["weights"]["existingClaim"] and not pvcs
        else:
            assert [p["metadata"]["name"] for p in pvcs] == [claim["claimName"]]


@pytest.mark.parametrize("config", CONFIGS)
def test_service_and_routes_point_at_the_serve_port(manifests, config):
    objects = manifests(config)
    rayservice = only(objects, "RayService")
    spec = rayservice["spec"]
    assert spec["upgradeStrategy"]["type"] in ("NewCluster", "None")
    svc = spec["serveService"]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["serve"], "KubeRay keeps only the port named 'serve'"
    port = svc["spec"]["ports"][0]["port"]
    for ingress in (o for o in objects if o["kind"] == "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"] == {"name": svc["metadata"]["name"], "port": {"name": "serve"}}
    for route in (o for o in objects if o["kind"] == "HTTPRoute"):
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["spec"]["parentRefs"]
        for rule in route["spec"]["rules"]:
            assert rule["backendRefs"] == [{"name": svc["metadata"]["name"], "port": port}]
    env = {e["name"]: e["value"] for e in only(objects, "Pod")["spec"]["containers"][0]["env"]}
    assert env["OPENAI_BASE_URL"].startswith(f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{port}")


def test_examples_cover_ingress_and_httproute(manifests):
    kinds = {o["kind"] for config in CONFIGS for o in manifests(config)}
    assert {"Ingress", "HTTPRoute", "PersistentVolumeClaim"} <= kinds


def test_notes_tell_how_to_call_and_test(helm):
    result = helm("install", "hs", str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    for needle in ("svc/hs-hybrid-serve-openai", "/v1/models", "/v1/chat/completions", "helm test hs", "Grafana"):
        assert needle in notes


@pytest.mark.parametrize("mode", ["high_throughput", "default"])
def test_ray_serve_mode_sets_the_data_path_on_every_ray_pod(manifests, template, mode):
    """serve.rayServeMode: every Ray pod's processes read the setting (HAProxy and the ingress replicas can live on
    the head or on workers); anything but the two modes is refused by the schema. Every Ray pod's raylet starts its
    workers (replicas, engine cores) at the pod's priority, not Ray's default 15 nice levels below."""
    rayservice = only(manifests("default", "--set", f"serve.rayServeMode={mode}"), "RayService")
    for role, tpl in pod_templates(rayservice).items():
        env = {e["name"]: e.get("value") for c in tpl["spec"]["containers"] for e in c.get("env", [])}
        flags = {k: env.get(k) for k in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED")}
        assert flags == dict.fromkeys(flags, "1" if mode == "high_throughput" else None), (role, flags)
        assert env.get("RAY_worker_niceness") == "0", role  # replicas and engine cores at the pod's priority
    refused = template("--set", "serve.rayServeMode=fast")
    assert refused.returncode != 0 and "rayServeMode" in refused.stderr
