"""The chart's hardening, checked on rendered manifests (defaults and every example): non-root pods with
the RuntimeDefault seccomp profile, containers without capabilities or privilege escalation on a
read-only root filesystem (Ray's writes go to emptyDirs), the API keys Secret mounted where the OpenAI
ingress runs and named in the Serve app's arguments, Ray token authentication, a NetworkPolicy that
admits only the ingress path to the OpenAI port and Prometheus to metrics; the images' non-root user."""

from __future__ import annotations

import base64

import pytest
import yaml

from service.deployments.args import AppArgs
from tests.helm.helm_chart_util import CONFIGS, load_values, only, pod_templates
from tests.helm.test_dockerfiles import DOCKERFILES, read_image

WRITABLE = {"/tmp", "/home/ray", "/dev/shm"}  # where Ray, Triton and torch write at run time


def pod_specs(objects: list[dict]) -> dict[str, dict]:
    tpls = pod_templates(only(objects, "RayService"))
    return {"head": tpls["head"]["spec"], "worker": tpls["worker"]["spec"], "test": only(objects, "Pod")["spec"]}


@pytest.mark.parametrize("config", CONFIGS)
def test_pods_run_non_root_read_only_without_capabilities(manifests, config):
    objects = manifests(config)
    for role, spec in pod_specs(objects).items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0 and pod["runAsGroup"] != 0, role
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, role
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), (role, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]} and "add" not in sc["capabilities"], (role, c["name"])
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True, (role, c["name"])
        if role == "test":
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        assert WRITABLE <= set(mounts), f"{role}: Ray needs writable {WRITABLE - set(mounts)}"
        for path in WRITABLE:
            assert "emptyDir" in volumes[mounts[path]], (role, path)
    assert not spec.get("automountServiceAccountToken", False)
    cluster = only(objects, "RayService")["spec"]["rayClusterConfig"]
    if cluster.get("enableInTreeAutoscaling"):
        sidecar = cluster["autoscalerOptions"]["securityContext"]
        assert sidecar["capabilities"] == {"drop": ["ALL"]} and sidecar["allowPrivilegeEscalation"] is False
        assert sidecar["runAsNonRoot"] is True


def _app_args(objects: list[dict]) -> AppArgs:
    serve_config = yaml.safe_load(only(objects, "RayService")["spec"]["serveConfigV2"])
    return AppArgs.model_validate(serve_config["applications"][0]["args"])


@pytest.mark.parametrize("config", CONFIGS)
def test_api_keys_secret_is_generated_and_mounted_where_the_ingress_runs(manifests, config):
    objects = manifests(config)
    values = load_values(config)["auth"]
    secret = only(objects, "Secret", "-api-keys")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    (key,) = base64.b64decode(secret["data"][values["secretKey"]]).decode().split()
    assert key.startswith("sk-") and len(key) >= 40
    args = _app_args(objects)
    assert args.api_keys_file == f"{values['mountPath']}/{values['secretKey']}"
    specs = pod_specs(objects)
    for role in ("worker", "test"):  # the ingress replica runs on workers (the head has num-cpus 0)
        volumes = {v["name"]: v for v in specs[role]["volumes"]}
        assert volumes["api-keys"]["secret"]["secretName"] == secret["metadata"]["name"]
        mount = next(m for m in specs[role]["containers"][0]["volumeMounts"] if m["name"] == "api-keys")
        assert mount["mountPath"] == values["mountPath"] and mount["readOnly"] is True
    assert "api-keys" not in {v["name"] for v in specs["head"]["volumes"]}
    head_params = only(objects, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head_params["num-cpus"] == "0"
    assert only(objects, "RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}


def test_existing_secret_and_limits_reach_the_app(manifests):
    objects = manifests(
        "default",
        "--set",
        "auth.existingSecret=team-keys",
        "--set",
        "limits.requestsPerMinute=60",
        "--set",
        "limits.tokensPerMinute=100000",
        "--set",
        "limits.maxN=2",
        "--set",
        "limits.maxStopStrings=4",
        "--set",
        "limits.maxTokens=null",
    )
    assert not [o for o in objects if o["kind"] == "Secret"]
    worker = pod_specs(objects)["worker"]
    assert {v["name"]: v for v in worker["volumes"]}["api-keys"]["secret"]["secretName"] == "team-keys"
    limits = _app_args(objects).limits
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_n) == (60, 100000, 2)
    assert limits.max_stop_strings == 4 and limits.concurrent_requests is None and limits.max_tokens is None
    off = manifests("default", "--set", "auth.enabled=false", "--set", "auth.rayTokenAuth=false")
    assert _app_args(off).api_keys_file is None and not [o for o in off if o["kind"] == "Secret"]
    assert "authOptions" not in only(off, "RayService")["spec"]["rayClusterConfig"]


def _rule_ports(rule: dict) -> set[int]:
    return {p["port"] for p in rule.get("ports", [])}


@pytest.mark.parametrize("config", CONFIGS)
def test_network_policy_admits_only_the_ingress_path_and_prometheus(manifests, config):
    objects = manifests(config)
    values = load_values(config)
    serve_port = values["serve"]["port"]
    rules = only(objects, "NetworkPolicy")["spec"]["ingress"]
    internal, others = rules[0], rules[1:]
    assert set(internal) == {"from"} and list(internal["from"][0]) == ["podSelector"], (
        "any port only within the release"
    )
    by_port: dict[int, list] = {}
    for rule in others:
        assert rule.get("from") and rule.get("ports"), f"a rule without peers or ports admits everyone: {rule}"
        for port in _rule_ports(rule):
            by_port.setdefault(port, []).append(rule["from"])
    assert by_port[serve_port][0] == values["networkPolicy"]["servePeers"]
    monitoring = [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": values["networkPolicy"]["monitoringNamespace"]}
            }
        }
    ]
    operator = [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": values["networkPolicy"]["operatorNamespace"]}
            }
        }
    ]
    assert by_port[8080] == [monitoring]
    assert by_port[8265] == [operator], "the dashboard (Serve REST API) only for the KubeRay operator"
    assert set(by_port) == {serve_port, 8080, 8265}, "GCS (6379), Ray client and other Ray ports admit no one"
    assert all(peers in (values["networkPolicy"]["servePeers"], operator) for peers in by_port[serve_port])
    head_ports = {p["containerPort"] for p in pod_specs(objects)["head"]["containers"][0]["ports"]}
    assert 10001 not in head_ports, "the Ray client port is not published"


def test_schema_refuses_an_open_serve_port(template):
    result = template("--set-json", "networkPolicy.servePeers=[]")
    assert result.returncode != 0 and "servePeers" in result.stderr


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_run_as_the_charts_non_root_user(name):
    image = read_image(DOCKERFILES[name])
    values = load_values("default")
    assert image.user.isdigit() and int(image.user) != 0, "a numeric non-root USER (runAsNonRoot can check it)"
    assert int(image.user) == values["podSecurityContext"]["runAsUser"]
    assert any(f"useradd --create-home --uid {image.user}" in r for r in image.runs)
    assert image.env.get("HOME") == "/home/ray" and image.env.get("PYTHONDONTWRITEBYTECODE") == "1", (
        "a read-only root: writes only under the home and /tmp emptyDirs"
    )
    assert not any("sudo" in r or "chmod 777" in r or "setcap" in r for r in image.runs)
