"""Hostile input against a live Serve app on 127.0.0.1: schemathesis generates requests (valid and not)
from the served OpenAPI document of /v1/chat/completions, /v1/completions and /v1/models; hand-written
cases send invalid UTF-8, a 10 MB body, deeply nested JSON, huge n, negative / NaN / huge numbers,
unknown fields, tool schemas that are not JSON Schema and prompts made only of special tokens. Never a
5xx, every error an OpenAI error object, and the server answers a normal request afterwards. The default
run is bounded (FUZZ_EXAMPLES per operation); `-m slow` runs the long one."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from service.engine.tokenizer import Tokenizer
from tests.deployments.conftest import deploy

KEY = "sk-fuzz-0123456789abcdef0123"
FUZZ_EXAMPLES, FUZZ_EXAMPLES_LONG = 40, 600  # generated requests per operation (default run / -m slow)
CAPS = {"max_tokens": 8, "max_prompt_tokens": 512, "max_n": 4}  # keep every admitted request cheap
OPERATIONS = (("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"))
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def fuzz_app(cluster, tiny_model_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("fuzz-secrets") / "keys"
    keys.write_text(KEY + "\n")
    return deploy(
        cluster,
        "fuzz",
        {
            "model_path": tiny_model_path,
            "replicas": 1,
            "canary": {"enabled": False},
            "api_keys_file": str(keys),
            "limits": CAPS,
        },
    )


@pytest.fixture(scope="module")
def http(fuzz_app):
    with httpx.Client(base_url=fuzz_app.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as c:
        yield c


def is_openai_error(resp: httpx.Response) -> bool:
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return (
        set(body) == {"error"}
        and isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and bool(err["message"])
        and isinstance(err.get("type"), str)
        and {"param", "code"} <= set(err)
    )


def openai_error_object(ctx, response, case) -> bool | None:
    """schemathesis check: every non-2xx answer is an OpenAI error object."""
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and body["error"]["message"] and body["error"]["type"], body
    return None


def assert_alive(fuzz_app) -> None:
    client = openai.OpenAI(base_url=fuzz_app.base_url, api_key=KEY, timeout=TIMEOUT_S, max_retries=0)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=4
    )
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1


def run_schemathesis(fuzz_app, examples: int) -> dict[str, int]:
    root = fuzz_app.base_url.removesuffix("/v1")
    schema = schemathesis.openapi.from_url(f"{root}/openapi.json")
    statuses: dict[str, int] = {}
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        openai_error_object,
    ]
    for path, method in OPERATIONS:
        operation = schema[path][method]
        cases = operation.as_strategy(GenerationMode.POSITIVE)
        if method == "POST":  # also bodies that violate the schema (wrong types, missing fields, ...)
            cases = st.one_of(cases, operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def call(case) -> None:
            response = case.call_and_validate(
                base_url=root, headers={"Authorization": f"Bearer {KEY}"}, checks=checks, timeout=TIMEOUT_S
            )
            key = f"{method} {path} {response.status_code}"  # noqa: B023  (call() runs inside this iteration)
            statuses[key] = statuses.get(key, 0) + 1

        call()
    return statuses


def test_served_openapi_document_describes_the_openai_routes(fuzz_app):
    doc = httpx.get(fuzz_app.base_url.removesuffix("/v1") + "/openapi.json", timeout=TIMEOUT_S).json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    assert {"200", "400", "401", "429", "default"} <= set(chat["responses"])
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]


def test_schemathesis_bounded(fuzz_app):
    statuses = run_schemathesis(fuzz_app, FUZZ_EXAMPLES)
    assert sum(statuses.values()) >= FUZZ_EXAMPLES, statuses
    assert any(k.endswith(" 200") and "completions" in k for k in statuses), f"nothing got through: {statuses}"
    print("schemathesis statuses:", statuses)
    assert_alive(fuzz_app)


@pytest.mark.slow
def test_schemathesis_long(fuzz_app):
    print("schemathesis statuses:", run_schemathesis(fuzz_app, FUZZ_EXAMPLES_LONG))
    assert_alive(fuzz_app)


def _special_prompts(model_path: str) -> list[tuple[str, dict]]:
    tok = Tokenizer.from_model_path(model_path)
    ids = sorted(tok.special_token_ids)
    text = "".join(tok.special_tokens.values())
    assert ids and text
    return [
        ("/completions", {"prompt": ids * 3, "max_tokens": 4}),
        ("/completions", {"prompt": text, "max_tokens": 4}),
        ("/completions", {"prompt": [ids, ids[:1]], "max_tokens": 2, "skip_special_tokens": False}),
        ("/chat/completions", {"messages": [{"role": "user", "content": text * 4}], "max_tokens": 4}),
        (
            "/chat/completions",
            {
                "messages": [{"role": "system", "content": text}, {"role": "user", "content": text}],
                "max_tokens": 4,
                "stop": [text[:3]],
            },
        ),
    ]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HOSTILE_JSON = [
    ("/chat/completions", {**CHAT, "n": 10**9}, 400),
    ("/chat/completions", {**CHAT, "n": 2**80}, 400),
    ("/completions", {"prompt": "x", "max_tokens": -5}, 400),
    ("/completions", {"prompt": "x", "max_tokens": 2**70}, 400),
    ("/completions", {"prompt": [-1, 5]}, 400),
    ("/completions", {"prompt": [2**64]}, 400),
    ("/chat/completions", {**CHAT, "top_p": -0.5}, 400),
    ("/chat/completions", {**CHAT, "temperature": 1e308 * 10}, 400),  # json.dumps writes Infinity
    ("/chat/completions", {**CHAT, "seed": -(2**90)}, 400),
    ("/completions", {"prompt": "x", "max_tokens": 2, "logprobs": -1}, 400),
    ("/chat/completions", {**CHAT, "unknown": {"deep": [1, {"x": None}]}, "store": True}, 200),
    (
        "/chat/completions",
        {
            **CHAT,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": 12, "properties": "not a schema", "$ref": "#/nowhere"},
                    },
                }
            ],
        },
        None,
    ),
    (
        "/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]},
        400,
    ),
    ("/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "", "parameters": {}}}]}, 400),
    (
        "/chat/completions",
        {
            **CHAT,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f" * 10_000,
                        "description": "\u0000\ud7ff" * 100,
                        "parameters": {"properties": {"a": {"enum": []}}},
                    },
                }
            ],
            "tool_choice": "required",
        },
        None,
    ),
    ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400),
]


@pytest.mark.parametrize("path,body,status", HOSTILE_JSON)
def test_hostile_json(http, path, body, status):
    resp = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert resp.status_code < 500, resp.text
    if status is not None:
        assert resp.status_code == status, resp.text
    if resp.status_code != 200:
        assert is_openai_error(resp), resp.text


@pytest.mark.parametrize(
    "name,raw,status",
    [
        ("invalid utf-8 in a string", b'{"prompt": "\xff\xfe\xc3\x28", "max_tokens": 2}', 400),
        ("invalid utf-8 outside strings", b'\xef\xbb\xbf\xff{"prompt": "x"}', 400),
        ("NaN literal", b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400),
        ("nested arrays 100k deep", b"[" * 100_000 + b"]" * 100_000, 400),
        ("nested objects in a field", b'{"prompt": "x", "unknown": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001, 400),
        (
            "nested content parts",
            b'{"messages": [{"role": "user", "content": ' + b"[" * 20_000 + b"]" * 20_000 + b"}]}",
            400,
        ),
        ("10 MB body", b'{"prompt": "' + b"a" * (10 * 1024 * 1024) + b'"}', 413),
        ("not an object", b'"just a string"', 400),
        ("empty body", b"", 400),
    ],
)
def test_hostile_bytes(http, name, raw, status):
    resp = http.post(
        "/completions" if "content parts" not in name else "/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
    assert is_openai_error(resp), resp.text[:300]


def test_prompts_of_only_special_tokens(http, fuzz_app):
    for path, body in _special_prompts(fuzz_app.model_path):
        resp = http.post(path, json=body)
        assert resp.status_code in (200, 400), (body, resp.text)
        if resp.status_code == 200:
            usage = resp.json()["usage"]
            assert usage["prompt_tokens"] >= 1 and 0 <= usage["completion_tokens"] <= body["max_tokens"] * 2
        else:
            assert is_openai_error(resp), resp.text
    assert_alive(fuzz_app)


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("GET", "/completions", 405),
        ("DELETE", "/models", 405),
        ("POST", "/engines/x/completions", 404),
        ("GET", "/%00%ff", 404),
    ],
)
def test_unknown_routes_and_methods_get_openai_errors(http, method, path, status):
    resp = http.request(method, path)
    assert resp.status_code == status and is_openai_error(resp), resp.text
