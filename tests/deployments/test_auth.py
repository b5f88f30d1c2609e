"""API keys and per-key limits on a live Serve app (127.0.0.1), through the real `openai` client and httpx:
401 without or with a wrong key, 200 with a right one; 429 + Retry-After when one key exceeds each limit
while another key is served; per-request caps -> 400 naming the limit; per-key counters on Ray's metrics
endpoint with key ids only; the open app (no keys) logs its warning once."""

from __future__ import annotations

import glob
import json
import os

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.deployments.auth import key_id
from tests.deployments.conftest import deploy
from tests.deployments.serve_testkit import METRICS_EXPORT_TIMEOUT_S, wait_until

KEYS = {name: f"sk-hybrid-{name}-0123456789abcdef" for name in ("rpm", "tpm", "conc", "caps", "other")}
LIMITS = {
    "requests_per_minute": 8,
    "tokens_per_minute": 1000,
    "concurrent_requests": 2,
    "max_tokens": 600,
    "max_n": 2,
    "max_stop_strings": 2,
    "max_top_logprobs": 2,
    "max_prompt_tokens": 200,
}
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def auth_app(cluster, tiny_model_path, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("secrets") / "api-keys"
    keys_file.write_text("# one key per line\n" + "\n".join(KEYS.values()) + "\n")
    return deploy(
        cluster,
        "auth",
        {
            "model_path": tiny_model_path,
            "replicas": 1,
            "canary": {"enabled": False},
            "api_keys_file": str(keys_file),
            "limits": LIMITS,
        },
    )


def _client(app, name: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {KEYS[name]}"} if name else {}
    return httpx.Client(base_url=app.base_url, headers=headers, timeout=TIMEOUT_S)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


def _served_normally(app) -> None:
    with _client(app, "other") as c:
        resp = c.post("/completions", json={"prompt": "another tenant", "max_tokens": 2})
        assert resp.status_code == 200, resp.text


def test_openai_client_needs_a_right_key(auth_app):
    for wrong in ("none", KEYS["other"] + "x"):
        client = openai.OpenAI(base_url=auth_app.base_url, api_key=wrong, timeout=TIMEOUT_S, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    with _client(auth_app, None) as c:
        for method, path in (("GET", "/models"), ("POST", "/completions"), ("POST", "/chat/completions")):
            resp = c.request(method, path, json={"prompt": "x"})
            assert resp.status_code == 401 and _error(resp)["code"] == "invalid_api_key", (path, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
        health = httpx.get(auth_app.base_url.removesuffix("/v1") + "/health", timeout=TIMEOUT_S)
        assert health.status_code == 200, "/health stays open"
    client = openai.OpenAI(base_url=auth_app.base_url, api_key=KEYS["other"], timeout=TIMEOUT_S, max_retries=0)
    assert client.models.list().data[0].id == "tiny"
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_requests_per_minute(auth_app):
    with _client(auth_app, "rpm") as c:
        codes = [c.post("/completions", json={"prompt": f"r{i}", "max_tokens": 1}).status_code for i in range(8)]
        assert codes == [200] * 8
        resp = c.post("/completions", json={"prompt": "one too many", "max_tokens": 1})
    assert resp.status_code == 429, resp.text
    err = _error(resp)
    assert err["code"] == "rate_limit_exceeded" and "requests_per_minute=8" in err["message"]
    assert 1 <= int(resp.headers["retry-after"]) <= 8
    _served_normally(auth_app)
    client = openai.OpenAI(base_url=auth_app.base_url, api_key=KEYS["rpm"], timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="tiny", prompt="again", max_tokens=1)


class HeldStream:
    """A streaming request held open after its first event until `close()` (the client leaves)."""

    def __init__(self, c: httpx.Client, max_tokens: int):
        self._cm = c.stream(
            "POST",
            "/completions",
            json={"prompt": "hold the line", "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
        )
        resp = self._cm.__enter__()
        assert resp.status_code == 200, resp.read()
        self._lines = resp.iter_lines()  # referenced: dropping the iterator would close the connection
        assert next(line for line in self._lines if line.startswith("data: {"))

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def test_tokens_per_minute_reserve_and_settle(auth_app):
    with _client(auth_app, "tpm") as c:
        held = HeldStream(c, 590)  # reserves its prompt + 590 of 1000
        resp = c.post("/completions", json={"prompt": "second", "max_tokens": 590})
        assert resp.status_code == 429, resp.text
        err = _error(resp)
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
        assert "tokens_per_minute=1000" in err["message"] and int(resp.headers["retry-after"]) >= 1
        _served_normally(auth_app)
        held.close()  # leaves after a few tokens: settled with the real count
        wait_until(
            lambda: c.post("/completions", json={"prompt": "third", "max_tokens": 590}).status_code == 200,
            timeout_s=60,  # released at once; the bound is for a loaded machine
            what="the unused reservation given back",
        )
        never = c.post("/completions", json={"prompt": "x", "max_tokens": 600, "n": 2})
        assert never.status_code == 400 and "tokens_per_minute=1000" in _error(never)["message"]


def test_concurrent_requests(auth_app):
    with _client(auth_app, "conc") as c:
        held = [HeldStream(c, 300), HeldStream(c, 300)]
        resp = c.post("/completions", json={"prompt": "third stream", "max_tokens": 1})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        assert "concurrent_requests=2" in _error(resp)["message"]
        _served_normally(auth_app)
        for stream in held:
            stream.close()
        wait_until(
            lambda: c.post("/completions", json={"prompt": "after", "max_tokens": 1}).status_code == 200,
            timeout_s=60,  # released at once; the bound is for a loaded machine
            what="the concurrency slots released",
        )


@pytest.mark.parametrize(
    "path,body,param,limit",
    [
        ("/completions", {"prompt": "x", "max_tokens": 601}, "max_tokens", "max_tokens=600"),
        ("/completions", {"prompt": "x", "max_tokens": 2, "n": 3}, "n", "max_n=2"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stop": ["a", "b", "c"]},
            "stop",
            "max_stop_strings=2",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3},
            "top_logprobs",
            "max_top_logprobs=2",
        ),
        ("/completions", {"prompt": list(range(20, 221)), "max_tokens": 2}, "prompt", "max_prompt_tokens=200"),
    ],
)
def test_per_request_caps_get_400_naming_the_limit(auth_app, path, body, param, limit):
    with _client(auth_app, "caps") as c:
        resp = c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param and limit in err["message"] and err["code"] == "limit_exceeded"


def test_unset_max_tokens_defaults_to_the_cap(auth_app):
    with _client(auth_app, "caps") as c:
        resp = c.post(
            "/chat/completions", json={"messages": [{"role": "user", "content": "go on"}], "ignore_eos": True}
        )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 600


def test_per_key_metrics_and_logs_hold_no_key_material(cluster, auth_app):
    with _client(auth_app, "other") as c:
        assert c.get("/models").status_code == 200
    ids = {key_id(k) for k in KEYS.values()}

    def samples() -> list:
        text = httpx.get(cluster.metrics_url, timeout=10).text
        return [
            s
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("ray_hybrid_serve_api_") and s.labels.get("application") == "auth"
        ]

    found = wait_until(
        lambda: (
            lambda got: got if {s.labels.get("key") for s in got} >= {key_id(KEYS["rpm"]), "unauthenticated"} else None
        )(samples()),
        timeout_s=METRICS_EXPORT_TIMEOUT_S,
        what="per-key API counters on the metrics endpoint",
    )
    by_name = {(s.name, s.labels["key"], s.labels.get("status") or s.labels.get("limit")): s.value for s in found}
    assert by_name[("ray_hybrid_serve_api_requests_total", key_id(KEYS["rpm"]), "429")] >= 1
    assert by_name[("ray_hybrid_serve_api_limit_refusals_total", key_id(KEYS["rpm"]), "requests_per_minute")] >= 1
    assert {s.labels["key"] for s in found} <= ids | {"unauthenticated"}
    every_label = json.dumps([s.labels for s in found])
    logs = "".join(open(p, errors="replace").read() for p in _serve_logs())
    for key in KEYS.values():
        assert key not in every_label and key not in logs


def _serve_logs() -> list[str]:
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    return glob.glob(os.path.join(session, "logs", "serve", "*.log"))


def test_open_app_warns_once(main_app, client):
    assert client.models.list().data, "no keys configured: the endpoint is open"
    warnings = [
        line
        for p in _serve_logs()
        if "replica_main_openai" in os.path.basename(p)
        for line in open(p, errors="replace")
        if "No API keys configured" in line
    ]
    assert len(warnings) == 1, warnings
