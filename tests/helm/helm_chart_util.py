"""Plain helpers shared by the Helm chart tests (fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "hybrid-serve"
EXAMPLES = CHART / "examples"
RELEASE = "hs"  # release name used for every render
NAMESPACE = "llm"  # release namespace used for every render
# Configurations every structural test runs on: the defaults and each example values file.
CONFIGS: tuple[str, ...] = ("default",) + tuple(sorted(p.stem for p in EXAMPLES.glob("*.yaml")))


@dataclass(frozen=True)
class HelmResult:
    returncode: int  # exit status of the helm process
    stdout: str  # rendered manifests (or lint report)
    stderr: str  # helm's error text


def find_helm() -> str:
    """The Helm binary: <repo>/.venv/bin/helm (scripts/install_tools.sh) or `helm` on PATH."""
    venv_helm = REPO / ".venv" / "bin" / "helm"
    if venv_helm.is_file():
        return str(venv_helm)
    on_path = shutil.which("helm")
    if on_path is None:
        pytest.fail(f"helm binary not found at {venv_helm} nor on PATH: run `bash scripts/install_tools.sh .venv`")
    return on_path


def values_args(config: str) -> list[str]:
    """`-f` arguments for a config name from CONFIGS."""
    return [] if config == "default" else ["-f", str(EXAMPLES / f"{config}.yaml")]


def only(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    """The single object of a kind (whose name ends with name_suffix)."""
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_templates(rayservice: dict) -> dict[str, dict]:
    """RayService head and worker pod templates by role: {"head": tpl, "worker": tpl}."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = cluster["workerGroupSpecs"]
    assert len(groups) == 1, "the chart renders exactly one worker group"
    return {"head": cluster["headGroupSpec"]["template"], "worker": groups[0]["template"]}


def load_values(config: str) -> dict:
    """The chart's values.yaml merged with an example file (plain recursive dict merge, as Helm does)."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if config != "default":
        values = merge(values, yaml.safe_load((EXAMPLES / f"{config}.yaml").read_text()))
    return values
