"""`hybrid-serve` entry point: one subcommand per concern, each defined next to its code."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function" taking (argparse subparsers) and registering itself
_SUBCOMMANDS = (
    "service.testing.tiny:add_cli",  # make-tiny-model
    "service.testing.model_dir:add_cli",  # make-model-dir
    "service.testing.quantize_fp8:add_cli",  # quantize-fp8
    "service.engine.generate_cli:add_cli",  # generate
    "service.deployments.serve_cli:add_cli",  # serve
    "service.training.cli:add_cli",  # train-tiny-model
    "service.evals.cli:add_cli",  # eval
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybrid-serve", description="NemotronH hybrid inference service")
    sub = parser.add_subparsers(dest="command", required=True)
    for spec in _SUBCOMMANDS:
        module, func = spec.split(":")
        getattr(importlib.import_module(module), func)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
