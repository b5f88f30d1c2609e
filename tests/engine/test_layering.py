"""The import rule of service/engine/README.md, checked on the source with `ast`."""

from __future__ import annotations

import ast
import pathlib

ENGINE = pathlib.Path(__file__).resolve().parents[2] / "service" / "engine"
FORBIDDEN_EVERYWHERE = (
    "ray",
    "fastapi",
    "starlette",
    "prometheus_client",
    "service.deployments",
    "service.openai",
    "service.testing",
)
RULES = {  # folder -> imported packages it must not use
    "kernels": (
        "service.engine.layers",
        "service.engine.model",
        "service.engine.runner",
        "service.engine.scheduler",
        "service.engine.cache",
        "service.engine.engine",
        "service.engine.config",
    ),
    "layers": ("service.engine.model", "service.engine.runner", "service.engine.scheduler", "service.engine.cache"),
    "model": ("service.engine.runner", "service.engine.scheduler", "service.engine.cache"),
    "scheduler": ("service.engine.model", "service.engine.layers", "service.engine.runner"),
    "cache": ("service.engine.model", "service.engine.layers", "service.engine.runner"),
}


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _violations(folder: pathlib.Path, banned: tuple[str, ...]) -> list[str]:
    return [
        f"{f.relative_to(folder)} imports {name}"
        for f in folder.rglob("*.py")
        for name in _imports(f)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]


def test_engine_never_imports_serving_stack():
    assert _violations(ENGINE, FORBIDDEN_EVERYWHERE) == []


def test_layer_direction():
    bad = [v for sub, banned in RULES.items() for v in _violations(ENGINE / sub, banned)]
    assert bad == []


def test_checker_sees_imports(tmp_path):
    (tmp_path / "x.py").write_text("import ray.serve\nfrom service.engine.model import y\n")
    assert _violations(tmp_path, ("ray",)) and _violations(tmp_path, ("service.engine.model",))


def test_parallel_context_imports_only_config():
    """layers/ and model/ import distributed/parallel.py; it must not import them (nor the runner) back."""
    names = _imports(ENGINE / "distributed" / "parallel.py")
    assert [n for n in names if n.startswith("service.")] == ["service.engine.config"]
