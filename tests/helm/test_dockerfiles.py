"""The images install the package like the README and start `hybrid-serve serve` with real flags.

Docker cannot build here, so the Dockerfiles are read with `dockerfile` (Docker's own Go parser,
BuildKit's frontend) and checked against the repository, the chart and the real CLI parser."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import dockerfile
import pytest
import ray
import yaml

from service.deployments.args import AppArgs
from service.engine.config import EngineConfig
from service.engine.kernels import cpu_native
from tests.helm.helm_chart_util import CHART, EXAMPLES, REPO

DOCKERFILES = {"gpu": REPO / "dockerfiles" / "gpu.Dockerfile", "cpu-demo": REPO / "dockerfiles" / "cpu-demo.Dockerfile"}
# `hybrid-serve serve` flags the images may use (the serving contract).
SERVE_FLAGS = {
    "--model-path",
    "--tp",
    "--ep",
    "--replicas",
    "--page-size",
    "--mamba-cache-strategy",
    "--reasoning-parser",
    "--tool-call-parser",
    "--host",
    "--port",
}


@dataclass(frozen=True)
class Image:
    base: str  # FROM image with ARG defaults substituted
    args: dict[str, str]  # ARG name -> default
    runs: tuple[str, ...]  # RUN shell commands, in order
    copies: tuple[tuple[str, ...], ...]  # COPY sources (last item: destination)
    user: str  # final USER
    env: dict[str, str]  # ENV name -> value (later ENV lines win)
    exposed: frozenset[int]  # EXPOSE ports
    cmd: tuple[str, ...]  # exec-form CMD


def read_image(path: Path) -> Image:
    commands = dockerfile.parse_file(str(path))
    args: dict[str, str] = {}
    for c in commands:
        if c.cmd == "ARG" and "=" in c.value[0]:
            key, default = c.value[0].split("=", 1)
            args[key] = default
    (base,) = [c.value[0] for c in commands if c.cmd == "FROM"]
    cmds = [c for c in commands if c.cmd == "CMD"]
    assert len(cmds) == 1 and cmds[0].json, "one exec-form (JSON) CMD, so signals reach hybrid-serve"
    return Image(
        base=re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base),
        args=args,
        runs=tuple(c.value[0] for c in commands if c.cmd == "RUN"),
        copies=tuple(c.value for c in commands if c.cmd == "COPY"),
        user=[c.value[0] for c in commands if c.cmd == "USER"][-1],
        env={k: v for c in commands if c.cmd == "ENV" for k, v in zip(c.value[::2], c.value[1::2])},
        exposed=frozenset(int(p) for c in commands if c.cmd == "EXPOSE" for p in c.value),
        cmd=cmds[0].value,
    )


def flag_values(cmd: tuple[str, ...]) -> dict[str, str]:
    assert cmd[:2] == ("hybrid-serve", "serve"), cmd
    rest = cmd[2:]
    assert len(rest) % 2 == 0 and all(f.startswith("--") for f in rest[::2]), rest
    return dict(zip(rest[::2], rest[1::2]))


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_image_installs_the_package_like_the_readme(name):
    image = read_image(DOCKERFILES[name])
    for *sources, _dest in image.copies:
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    copied = {s for *sources, _ in image.copies for s in sources}
    assert {"pyproject.toml", "service"} <= copied
    installs = [r for r in image.runs if re.search(r"\bpip install\b.*(\s\.(\s|$))", r)]
    assert len(installs) == 1, "one `pip install .` of the repository"
    assert "ray[serve]==${RAY_VERSION}" in installs[0]
    torch_runs = [r for r in image.runs if re.search(r"pip install \S*(torch|TORCH)", r)]
    assert torch_runs and image.runs.index(torch_runs[0]) < image.runs.index(installs[0]), "torch before the package"
    assert any(re.search(r"apt-get install .*\bwget\b", r) for r in image.runs), "KubeRay's probes run wget"
    assert image.user == str(yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"])


def test_ray_version_matches_the_chart_and_the_tested_ray():
    chart_ray = yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]
    for path in DOCKERFILES.values():
        assert read_image(path).args["RAY_VERSION"] == chart_ray
    assert ray.__version__ == chart_ray, "the Serve schema tests run against the Ray the images ship"


def test_gpu_image_is_cuda_based_and_keeps_the_venv_on_login_shells():
    image = read_image(DOCKERFILES["gpu"])
    assert image.base.startswith("nvidia/cuda:") and "runtime" in image.base
    assert image.args["TORCH_SPEC"] == "torch", "the README's GPU install: default PyPI torch"
    # KubeRay starts `bash -lc 'ray start ...'`; Debian/Ubuntu's /etc/profile resets PATH.
    assert any("/etc/profile.d/" in r and "/opt/venv/bin" in r for r in image.runs)
    assert any("gcc" in r and "python3-dev" in r for r in image.runs), "Triton compiles its launcher at run time"


def test_cpu_image_takes_torch_from_the_cpu_index_and_bakes_the_tiny_model():
    image = read_image(DOCKERFILES["cpu-demo"])
    makefile_pin = re.search(r"torch==([0-9.]+)", (REPO / "Makefile").read_text()).group(1)
    assert image.args["TORCH_VERSION"] == makefile_pin
    assert any('"torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in r for r in image.runs)
    (make,) = [r for r in image.runs if "make-tiny-model" in r]
    model_dir = make.split("make-tiny-model", 1)[1].split()[0]
    assert flag_values(image.cmd)["--model-path"] == model_dir
    demo = yaml.safe_load((EXAMPLES / "cpu-demo.yaml").read_text())
    assert demo["model"]["path"] == model_dir and not demo["weights"]["enabled"]
    assert demo["image"]["repository"].endswith("cpu-demo")


def test_cpu_image_builds_the_native_kernels_where_the_read_only_root_keeps_them(monkeypatch):
    """The CPU default kernel backend compiles C kernels at first use: the image has gcc, and builds them once,
    after the package is installed, into the cache folder the engine reads (`HYBRID_SERVE_NATIVE_CACHE`)."""
    image = read_image(DOCKERFILES["cpu-demo"])
    assert any(re.search(r"apt-get install .*\bgcc\b", r) for r in image.runs)
    assert EngineConfig(model_path="m", device="cpu").resolved().kernel_backend == "native"
    cache = image.env["HYBRID_SERVE_NATIVE_CACHE"]
    assert cache.startswith("/opt/") and not cache.startswith(image.env["HOME"])
    (build,) = [r for r in image.runs if "native_library()" in r]
    (install,) = [r for r in image.runs if re.search(r"\bpip install\b.*(\s\.(\s|$))", r)]
    assert image.runs.index(install) < image.runs.index(build)
    monkeypatch.setenv("HYBRID_SERVE_NATIVE_CACHE", cache)
    assert cpu_native.cache_dir() == Path(cache)  # where the engine looks at run time


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_cmd_uses_real_serve_flags(name):
    image = read_image(DOCKERFILES[name])
    flags = flag_values(image.cmd)
    assert set(flags) <= SERVE_FLAGS, set(flags) - SERVE_FLAGS
    assert flags["--reasoning-parser"] == "nemotron_3" and flags["--tool-call-parser"] == "qwen3_coder"
    assert flags["--host"] == "0.0.0.0" and int(flags["--port"]) in image.exposed
    AppArgs(
        model_path=flags["--model-path"],
        tp=int(flags["--tp"]),
        ep=int(flags["--ep"]),
        replicas=int(flags["--replicas"]),
        page_size=int(flags["--page-size"]),
        mamba_cache_strategy=flags["--mamba-cache-strategy"],
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_cmd_parses_with_the_real_cli(name):
    """The CMD goes through `hybrid-serve`'s own argparse parser and yields valid AppArgs."""
    from service.cli import build_parser
    from service.deployments.serve_cli import app_args_from_cli

    image = read_image(DOCKERFILES[name])
    namespace = build_parser().parse_args(list(image.cmd[1:]))
    assert namespace.command == "serve" and namespace.port == int(flag_values(image.cmd)["--port"])
    AppArgs.model_validate(app_args_from_cli(namespace))
