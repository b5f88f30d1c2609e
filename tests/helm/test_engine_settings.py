"""Every EngineConfig setting is reachable, under its own name, from `hybrid-serve serve`,
`hybrid-serve generate` and the Helm chart, and arrives in the engine's config unchanged.

Oracles: argparse's own parsing and --help text of the real `hybrid-serve` parser, the real `helm`
binary rendering the chart (which applies values.schema.json), and pydantic validating AppArgs."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from service.cli import build_parser
from service.deployments import chart_schema
from service.deployments.args import AppArgs
from service.deployments.serve_cli import app_args_from_cli
from service.engine.config import EngineConfig
from service.engine.settings import Setting, add_setting_arguments, settings_from_namespace, settings_of
from tests.helm.helm_chart_util import CHART, load_values

SETTINGS = settings_of(EngineConfig)
MODEL = "/models/m"


def other_value(s: Setting):
    """A valid value of `s` that differs from its default."""
    if s.choices is not None:
        return next(c for c in s.choices if c != s.default)
    if s.type is bool:
        return not s.default
    if s.type is int:
        return (s.default or max(s.minimum or 0, 1)) + 1
    if s.type is float:
        return s.default / 2 if s.default else 0.5
    return {"model_path": MODEL, "device": "cpu"}[s.name]


def non_default_config() -> EngineConfig:
    cfg = EngineConfig(**{s.name: other_value(s) for s in SETTINGS})
    cfg.validate()
    return cfg


def test_every_setting_is_a_serve_flag_in_help():
    help_text = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for s in SETTINGS:
        assert re.search(rf"^\s+{re.escape(s.flag)}\b", help_text, re.M), f"{s.flag} missing from serve --help"
        assert s.help.split(";")[0][:30] in " ".join(help_text.split()), f"help of {s.flag} not shown"


def test_serve_flags_reach_the_engine_config():
    want = non_default_config()
    argv = ["serve"]
    for s in SETTINGS:
        value = getattr(want, s.name)
        argv += [s.flag if value else "--no-" + s.flag[2:]] if s.type is bool else [s.flag, str(value)]
    args = AppArgs.model_validate(app_args_from_cli(build_parser().parse_args(argv)))
    assert args.engine_config() == want


def test_generate_flags_reach_the_engine_config():
    want = non_default_config()
    argv = ["generate", "--prompt", "x"]
    for s in SETTINGS:
        value = getattr(want, s.name)
        argv += [s.flag if value else "--no-" + s.flag[2:]] if s.type is bool else [s.flag, str(value)]
    assert EngineConfig(**settings_from_namespace(build_parser().parse_args(argv), EngineConfig)) == want


def test_unset_flags_keep_the_engine_defaults_and_alias_works():
    ns = build_parser().parse_args(["serve", "--model-path", MODEL, "--mamba-scheduler-strategy", "off"])
    assert AppArgs.model_validate(app_args_from_cli(ns)).engine_config() == EngineConfig(
        model_path=MODEL, mamba_cache_strategy="off"
    )
    assert AppArgs(model_path=MODEL).engine_config() == EngineConfig(model_path=MODEL)


def test_every_setting_is_in_the_chart_schema_and_values():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    engine_props = schema["properties"]["engine"]["properties"]
    values = load_values("default")
    assert "path" in schema["properties"]["model"]["properties"]  # model_path is model.path
    for s in chart_schema.engine_settings():
        assert s.camel_name in engine_props, f"engine.{s.camel_name} missing from values.schema.json"
        assert s.camel_name in values["engine"], f"engine.{s.camel_name} missing from values.yaml"
    assert chart_schema.synced(schema) == schema, "run: python -m service.deployments.chart_schema"
    assert chart_schema.main(["--check"]) == 0


def test_chart_defaults_agree_with_the_engine():
    """values.yaml keeps the engine's defaults (null: the engine decides), except the chart's GPU sizing."""
    chart_choices = {"pageSize", "maxNumBatchedTokens"}
    values = load_values("default")["engine"]
    for s in chart_schema.engine_settings():
        if s.camel_name not in chart_choices:
            assert values[s.camel_name] == s.default, f"engine.{s.camel_name}: chart {values[s.camel_name]!r}"


def test_template_skips_exactly_the_deployment_keys():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    (line,) = [ln for ln in helpers.splitlines() if "$deploymentKeys := list" in ln]
    assert tuple(re.findall(r'"([A-Za-z]+)"', line)) == chart_schema.DEPLOYMENT_KEYS


def test_chart_values_reach_the_engine_config(template, tmp_path):
    want = non_default_config()
    overrides = {s.camel_name: getattr(want, s.name) for s in chart_schema.engine_settings()}
    overrides["numKvPages"] = 1_000_000  # large whole numbers stay integers through Helm's float64
    want = dataclasses.replace(want, num_kv_pages=1_000_000, model_path=MODEL)
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {"engine": overrides, "model": {"path": MODEL, "mambaGroups": None}, "weights": {"mountPath": "/models"}}
        )
    )
    result = template("-f", str(path))
    assert result.returncode == 0, result.stderr
    rayservice = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "RayService")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert AppArgs.model_validate(args).engine_config() == want


def test_nulls_in_the_chart_leave_the_engine_default(template):
    result = template("--set", "engine.kernelBackend=null", "--set", "engine.maxModelLen=null")
    rayservice = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "RayService")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "kernel_backend" not in args and "max_model_len" not in args
    assert AppArgs.model_validate(args).engine_config().kernel_backend is None


def test_kernel_backend_follows_the_device():
    cfg = EngineConfig(model_path=MODEL)
    assert cfg.resolved().kernel_backend == ("triton" if cfg.resolved().device == "cuda" else "native")
    assert EngineConfig(model_path=MODEL, device="cuda:1").resolved().kernel_backend == "triton"
    assert EngineConfig(model_path=MODEL, device="cpu").resolved().kernel_backend == "native"
    assert EngineConfig(model_path=MODEL, device="cpu", kernel_backend="triton").resolved().kernel_backend == "triton"


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"device": "tpu"}, "device must match"),
        ({"kernel_backend": "cuda"}, "kernel_backend must be one of"),
        ({"cuda_graphs": 1}, "cuda_graphs must be bool"),
        ({"max_model_len": "8"}, "max_model_len must be int or None"),
    ],
)
def test_declared_checks_name_the_setting(bad, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        EngineConfig(model_path=MODEL, **bad).validate()


def test_derivation_handles_each_field_type_and_rejects_others():
    @dataclasses.dataclass(frozen=True)
    class Demo:
        flag: bool = dataclasses.field(default=True, metadata={"help": "a switch"})
        ratio: float | None = dataclasses.field(default=None, metadata={"help": "a ratio", "min": 0.0})
        mode: str = dataclasses.field(default="a", metadata={"help": "a mode", "choices": ("a", "b")})

    parser = argparse.ArgumentParser()
    add_setting_arguments(parser, Demo, "demo")
    assert settings_from_namespace(parser.parse_args([]), Demo) == {}
    assert settings_from_namespace(parser.parse_args(["--no-flag", "--ratio", "0.5", "--mode", "b"]), Demo) == {
        "flag": False,
        "ratio": 0.5,
        "mode": "b",
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])

    @dataclasses.dataclass(frozen=True)
    class Bad:
        items: list = dataclasses.field(default_factory=list, metadata={"help": "no"})

    with pytest.raises(TypeError, match="items"):
        settings_of(Bad)

    @dataclasses.dataclass(frozen=True)
    class NoHelp:
        x: int = 1

    with pytest.raises(TypeError, match="help"):
        settings_of(NoHelp)
