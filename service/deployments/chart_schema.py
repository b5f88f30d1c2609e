"""The Helm chart's engine values, derived from `EngineConfig`.

Every engine setting is a key of the chart's `engine:` values, named as the field in camelCase
(`page_size` -> `engine.pageSize`; `model_path` is `model.path`). The chart's template turns the
keys back into snake_case app arguments. `values.schema.json` holds the schema of each key as
`service.engine.settings.json_schema` writes it; `python -m service.deployments.chart_schema`
rewrites those entries after a setting changes, and `--check` (run by the tests) reports drift.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from service.engine.config import EngineConfig
from service.engine.settings import Setting, json_schema, settings_of

CHART = pathlib.Path(__file__).resolve().parents[2] / "helm" / "hybrid-serve"
SCHEMA_PATH = CHART / "values.schema.json"
# `engine:` keys that are the app's deployment arguments, not engine settings (the template skips them)
DEPLOYMENT_KEYS = (
    "replicas",
    "autoscaling",
    "maxOngoingRequests",
    "cpusPerReplica",
    "reasoningParser",
    "toolCallParser",
)


def engine_settings() -> tuple[Setting, ...]:
    """The EngineConfig settings set through `engine:` values (all but model_path)."""
    return tuple(s for s in settings_of(EngineConfig) if s.name != "model_path")


def engine_value_schemas() -> dict[str, Any]:
    """`engine.<camelName>` -> its JSON Schema, for every engine setting."""
    return {s.camel_name: json_schema(s) for s in engine_settings()}


def synced(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (the chart's values schema) with its engine settings' entries rewritten from EngineConfig.

    Entries of settings that no longer exist are dropped; deployment keys are left as they are.
    """
    engine = schema["properties"]["engine"]
    wanted = engine_value_schemas()
    props = {k: v for k, v in engine["properties"].items() if k in DEPLOYMENT_KEYS or k in wanted}
    props.update(wanted)
    return {**schema, "properties": {**schema["properties"], "engine": {**engine, "properties": props}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if values.schema.json is out of date")
    args = p.parse_args(argv)
    current = json.loads(SCHEMA_PATH.read_text())
    new = synced(current)
    if args.check:
        if new != current:
            print(f"{SCHEMA_PATH} is out of date: run python -m service.deployments.chart_schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(json.dumps(new, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
