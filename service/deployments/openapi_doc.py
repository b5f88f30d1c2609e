"""The OpenAI routes in the ingress' served OpenAPI document (`GET <route_prefix>/openapi.json`).

The handlers read their bodies themselves (so that every validation failure becomes an OpenAI error),
which leaves FastAPI's generated document without request bodies; this fills in the request models of
`service.openai.protocol`, the JSON and SSE success responses, the OpenAI error object for every error
status, and the Bearer scheme. Clients, generators and API fuzzers (the tests run schemathesis on it)
read this document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)

_ERROR_STATUSES = {
    "400": "Invalid request, or a per-request cap exceeded",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "429": "A per-key limit exceeded (see Retry-After)",
    "503": "Overloaded or no engine replica",
}
# One server-sent event (stream: true): `data` is a JSON chunk (or an OpenAI error object), the last one [DONE].
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
_EXAMPLES = {
    ChatCompletionRequest: {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
    CompletionRequest: {"prompt": "The weather is", "max_tokens": 8},
}
# path -> (method, request model or None, JSON success model, whether the route streams SSE)
_ROUTES: dict[str, tuple[str, type[BaseModel] | None, type[BaseModel], bool]] = {
    "/v1/chat/completions": ("post", ChatCompletionRequest, ChatCompletionResponse, True),
    "/v1/completions": ("post", CompletionRequest, CompletionResponse, True),
    "/v1/models": ("get", None, ModelList, False),
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def openai_paths() -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """(path -> {method: operation}, component schemas) for the OpenAI routes."""
    models = [(m, "validation") for _, m, _, _ in _ROUTES.values() if m is not None]
    models += [(m, "serialization") for _, _, m, _ in _ROUTES.values()] + [(ErrorResponse, "serialization")]
    refs, top = models_json_schema(models, ref_template="#/components/schemas/{model}")
    error = {"description": "OpenAI error object", "content": _json(refs[(ErrorResponse, "serialization")])}
    paths: dict[str, dict[str, Any]] = {}
    for path, (method, request, response, streams) in _ROUTES.items():
        ok = _json(refs[(response, "serialization")])
        if streams:
            ok["text/event-stream"] = {"schema": _SSE_EVENT}
        op: dict[str, Any] = {
            "responses": {
                "200": {"description": "Success", "content": ok},
                **{code: {**error, "description": why} for code, why in _ERROR_STATUSES.items()},
                "default": error,
            },
            "security": [{"bearer": []}],
        }
        if request is not None:
            body = _json(refs[(request, "validation")])
            body["application/json"]["example"] = _EXAMPLES[request]
            op["requestBody"] = {"required": True, "content": body}
        paths[path] = {method: op}
    return paths, top.get("$defs", {})


def document_openai_routes(app: FastAPI) -> None:
    """Make `app.openapi()` (served at /openapi.json) describe the OpenAI routes' bodies and errors."""
    generated: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = generated()
        paths, schemas = openai_paths()
        for path, methods in paths.items():
            for method, op in methods.items():
                doc.setdefault("paths", {}).setdefault(path, {}).setdefault(method, {}).update(op)
        components = doc.setdefault("components", {})
        components.setdefault("schemas", {}).update(schemas)
        components.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
