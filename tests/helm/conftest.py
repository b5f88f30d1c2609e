"""Fixtures for the Helm chart tests: the real `helm` binary and cached rendering.

Rendering runs `helm template` (the real Helm v4 engine) and parses its YAML stream."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest
import yaml

from tests.helm.helm_chart_util import CHART, NAMESPACE, RELEASE, HelmResult, find_helm, values_args


@pytest.fixture(scope="session")
def helm() -> Callable[..., HelmResult]:
    """Runs `helm ARGS...` with a 30 s bound and returns its result."""
    binary = find_helm()

    def run(*args: str) -> HelmResult:
        proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
        return HelmResult(proc.returncode, proc.stdout, proc.stderr)

    return run


@pytest.fixture(scope="session")
def template(helm) -> Callable[..., HelmResult]:
    """`helm template` of the chart with extra arguments (values files, --set), cached by arguments."""
    cache: dict[tuple[str, ...], HelmResult] = {}

    def render(*extra: str) -> HelmResult:
        if extra not in cache:
            cache[extra] = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra)
        return cache[extra]

    return render


@pytest.fixture(scope="session")
def manifests(template) -> Callable[..., list[dict]]:
    """Rendered objects of a config (name from CONFIGS) plus extra helm args; fails on a render error."""

    def load(config: str, *extra: str) -> list[dict]:
        result = template(*values_args(config), *extra)
        assert result.returncode == 0, f"helm template failed for {config} {extra}:\n{result.stderr}"
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return load
