"""The chart's custom objects against the CRDs their operators publish (KubeRay v1.7.0, Prometheus Operator
v0.93.0), read from `<repo>/../shared/k8s-crds/`: every RayService (and its embedded RayCluster spec),
RayCluster, PodMonitor, ServiceMonitor and PrometheusRule of the default render and of every example is
validated against its CRD's openAPIV3Schema with unknown fields rejected, as `kubectl apply
--validate=strict` does: `additionalProperties: false` is added wherever a schema lists properties and
does not say `x-kubernetes-preserve-unknown-fields`."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helm.helm_chart_util import CONFIGS, REPO

CRD_DIR = REPO.parent / "shared" / "k8s-crds"
CRD_FILES = {
    "RayService": "ray.io_rayservices.yaml",
    "RayCluster": "ray.io_rayclusters.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}

pytestmark = pytest.mark.skipif(
    not CRD_DIR.is_dir(),
    reason=f"the published CRDs are not at {CRD_DIR} (see shared/k8s-crds/README.md): nothing to validate against",
)


def strict(schema: dict) -> dict:
    """A copy of an openAPIV3Schema that rejects fields it does not list."""
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif isinstance(value, dict):
            out[key] = strict(value)
        elif isinstance(value, list):
            out[key] = [strict(v) if isinstance(v, dict) else v for v in value]
        else:
            out[key] = value
    if (
        "properties" in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


@cache
def load_crd(kind: str) -> dict:
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    return crd


@cache
def crd_validator(kind: str, version: str) -> jsonschema.Draft7Validator:
    crd = load_crd(kind)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"], f"{kind} {version} is not served by this CRD"
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def errors(obj: dict) -> list[str]:
    group_version = obj["apiVersion"]
    validator = crd_validator(obj["kind"], group_version.split("/")[1])
    assert group_version.split("/")[0] == load_crd(obj["kind"])["spec"]["group"]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def custom_objects(objects: list[dict]) -> list[dict]:
    """The rendered custom objects, plus each RayService's rayClusterConfig as the RayCluster it becomes."""
    found = [o for o in objects if o["kind"] in CRD_FILES]
    for svc in [o for o in found if o["kind"] == "RayService"]:
        found.append(
            {
                "apiVersion": svc["apiVersion"],
                "kind": "RayCluster",
                "metadata": {"name": "embedded"},
                "spec": svc["spec"]["rayClusterConfig"],
            }
        )
    return found


@pytest.mark.parametrize("config", CONFIGS)
def test_custom_objects_match_the_published_crds(manifests, config):
    objects = custom_objects(manifests(config))
    kinds = {o["kind"] for o in objects}
    assert {"RayService", "RayCluster", "PodMonitor", "PrometheusRule"} <= kinds, kinds
    problems = {f"{o['kind']}/{o['metadata']['name']}": errors(o) for o in objects}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}


def test_the_check_rejects_unknown_fields_and_wrong_types(manifests):
    """The same validation fails on what the API server would refuse (so the test above can fail)."""
    svc = next(o for o in manifests("default") if o["kind"] == "RayService")
    unknown = copy.deepcopy(svc)
    unknown["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {"typo": "1"}
    assert any("rayStartParam" in e for e in errors(unknown))
    wrong_type = copy.deepcopy(svc)
    wrong_type["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("replicas" in e for e in errors(wrong_type))
    bad_auth = copy.deepcopy(svc)
    bad_auth["spec"]["rayClusterConfig"]["authOptions"] = {"mode": "password"}
    assert any("authOptions.mode" in e for e in errors(bad_auth))
    monitor = copy.deepcopy(next(o for o in manifests("default") if o["kind"] == "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["scrapeEvery"] = "15s"
    assert any("scrapeEvery" in e for e in errors(monitor))
    assert (
        strict({"type": "object", "properties": {"a": {}}, "x-kubernetes-preserve-unknown-fields": True}).get(
            "additionalProperties"
        )
        is None
    )


def test_crd_folder_is_where_the_readme_says():
    assert Path(CRD_DIR / "README.md").is_file() and set(CRD_FILES.values()) <= {p.name for p in CRD_DIR.iterdir()}
