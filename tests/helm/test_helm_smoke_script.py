"""The `helm test` pod's script (files/openai_smoke.py, run by the chart as `python3 -c`) passes
against OpenAI-shaped answers and fails on errors.

The answers it gets here are built from the `openai` package's own response types, served on
127.0.0.1; the script runs in a subprocess exactly as the pod runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from openai.types import Model
from openai.types.chat import ChatCompletion

from tests.helm.helm_chart_util import CHART, only

SCRIPT = (CHART / "files" / "openai_smoke.py").read_text()


def chat_completion(model: str, content: str | None, reasoning: str | None) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning  # extra field, as reasoning parsers add it
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "finish_reason": "length", "message": message}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21},
        }
    ).model_dump(mode="json")


class FakeOpenAI(BaseHTTPRequestHandler):
    chat_status = 200  # set per test
    chat_body: dict = {}
    requests: list[tuple[str, dict | None]] = []

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        FakeOpenAI.requests.append((self.path, None))
        model = Model(id="tiny-nemotron-h", created=0, object="model", owned_by="hybrid-serve").model_dump(mode="json")
        self._send(200 if self.path == "/v1/models" else 404, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAI.requests.append((self.path, body))
        self._send(self.chat_status, self.chat_body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    FakeOpenAI.requests = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def run_script(base_url: str) -> subprocess.CompletedProcess:
    env = {"OPENAI_BASE_URL": base_url, "SMOKE_TIMEOUT_S": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("content,reasoning", [("Hello", None), (None, "The user wants a greeting")])
def test_smoke_script_passes_on_a_good_endpoint(server, content, reasoning):
    FakeOpenAI.chat_status, FakeOpenAI.chat_body = 200, chat_completion("tiny-nemotron-h", content, reasoning)
    result = run_script(server)
    assert result.returncode == 0, result.stderr
    assert "ok: model=tiny-nemotron-h" in result.stdout
    ((path, body),) = [r for r in FakeOpenAI.requests if r[1] is not None]
    assert (
        path == "/v1/chat/completions" and body["model"] == "tiny-nemotron-h" and body["messages"][0]["role"] == "user"
    )


@pytest.mark.parametrize(
    "status,body",
    [
        (500, {"error": {"message": "engine died", "type": "server_error", "code": 500}}),
        (200, {"id": "x", "choices": [], "usage": {"completion_tokens": 0}}),
    ],
)
def test_smoke_script_fails_on_a_bad_endpoint(server, status, body):
    FakeOpenAI.chat_status, FakeOpenAI.chat_body = status, body
    result = run_script(server)
    assert result.returncode == 1 and "FAILED" in result.stderr


def test_smoke_script_fails_when_nothing_listens():
    result = run_script("http://127.0.0.1:9")
    assert result.returncode == 1 and "never listed a model" in result.stderr


def test_chart_runs_the_script_verbatim(manifests):
    pod = only(manifests("default"), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (c,) = pod["spec"]["containers"]
    assert c["command"] == ["python3", "-c"] and c["args"] == [SCRIPT]
    assert yaml.safe_load(c["env"][1]["value"]) > 0
