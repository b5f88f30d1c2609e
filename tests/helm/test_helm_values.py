"""Bad values make `helm template` fail, and the message names the field and the rejected value.

Oracle: the real Helm engine, which applies values.schema.json and the chart's `fail` checks."""

from __future__ import annotations

import pytest
import yaml

from service.deployments.args import AppArgs

# (--set arguments, substrings the error must contain: the field and the rejected value)
BAD_VALUES: list[tuple[tuple[str, ...], tuple[str, ...]]] = [
    (("engine.replicas=0",), ("/engine/replicas", "got 0")),
    (("engine.replicas=-2",), ("/engine/replicas", "got -2")),
    (("engine.tp=3",), ("engine.tp=3", "model.mambaGroups=8")),
    (("engine.tp=16",), ("engine.tp=16", "model.mambaGroups=8")),
    (("engine.mambaCacheStrategy=bogus",), ("/engine/mambaCacheStrategy", "'bogus'")),
    (("engine.mambaCacheStrategy=no_buffer",), ("engine.mambaCacheStrategy=no_buffer", "engine.pageSize=64")),
    (("engine.pageSize=0",), ("/engine/pageSize", "got 0")),
    (("engine.ep=0",), ("/engine/ep", "got 0")),
    (("engine.device=tpu",), ("/engine/device", "'tpu'")),
    (("router.kind=random",), ("/router/kind", "'random'")),
    (("canary.auditSampleRate=2",), ("/canary/auditSampleRate", "got 2")),
    (
        ("engine.autoscaling.enabled=true", "engine.autoscaling.minReplicas=5", "engine.autoscaling.maxReplicas=2"),
        ("minReplicas=5", "maxReplicas=2"),
    ),
    (("engine.tp=2", "engine.ep=4"), ("engine.ep=4", "engine.tp=2")),
    (("model.mambaGroups=null", "engine.tp=16"), ("engine.tp=16", "workers.maxGpusPerPod=8")),
    (("model.path=models/nano",), ("/model/path", "'models/nano'")),
    (("model.path=/data/nano",), ('model.path="/data/nano"', 'weights.mountPath="/models"')),
    (
        ("upgradeStrategy.type=NewClusterWithIncrementalUpgrade",),
        ("/upgradeStrategy/type", "'NewClusterWithIncrementalUpgrade'"),
    ),
    (("httpRoute.enabled=true",), ("/httpRoute/parentRefs", "got 0")),
    (("engine.cacheStrtegy=off",), ("additional properties", "'cacheStrtegy'")),
]


def set_args(assignments: tuple[str, ...]) -> list[str]:
    return [arg for a in assignments for arg in ("--set", a)]


@pytest.mark.parametrize("assignments,needles", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_fail_with_a_message_naming_the_value(template, assignments, needles):
    result = template(*set_args(assignments))
    assert result.returncode != 0, f"helm template accepted {assignments}"
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in helm's error:\n{result.stderr}"


@pytest.mark.parametrize(
    "assignments",
    [
        ("engine.tp=8",),  # divides 8 mamba groups
        ("engine.tp=4", "engine.ep=4"),  # 4 GPUs: one pod
        ("engine.tp=8", "engine.ep=8"),  # 8 GPUs: a whole pod
        ("model.mambaGroups=null", "engine.tp=3"),  # unchecked when the groups are not given
        ("engine.mambaCacheStrategy=no_buffer", "engine.pageSize=1"),
        ("engine.mambaCacheStrategy=off",),
        ("engine.autoscaling.enabled=true", "engine.autoscaling.minReplicas=1", "engine.autoscaling.maxReplicas=3"),
    ],
)
def test_good_edge_values_render_and_validate(template, assignments):
    """The checks are not over-strict: these render, and their Serve args pass AppArgs."""
    result = template(*set_args(assignments))
    assert result.returncode == 0, result.stderr
    rayservice = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "RayService")
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    AppArgs.model_validate(args)
