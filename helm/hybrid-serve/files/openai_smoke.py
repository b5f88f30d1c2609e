"""`helm test` smoke check: the OpenAI endpoint lists a model and completes one chat request.

Standard library only (runs in any image with python3). Env: OPENAI_BASE_URL (e.g.
http://NAME-openai.NS.svc:8000), SMOKE_TIMEOUT_S (seconds to wait for the model to come up),
OPENAI_API_KEY_FILE (optional: the API keys file; its first key is sent as a Bearer token).
Exit code 0 on success, 1 with a reason on stderr otherwise."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request


def api_key() -> str | None:
    """The first key of OPENAI_API_KEY_FILE (one key per line, # comments), if that variable is set."""
    path = os.environ.get("OPENAI_API_KEY_FILE")
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        keys = [ln.strip() for ln in f if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise RuntimeError(f"{path} holds no API key")
    return keys[0]


def call(url: str, body: dict | None, timeout_s: float) -> tuple[int, dict]:
    """One HTTP request; returns (status, parsed JSON body or {"raw": text})."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    key = api_key()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, {"raw": text[:500]}


def wait_for_model(base_url: str, deadline: float) -> str:
    """Polls /v1/models until it lists a model; returns the first model id."""
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            status, body = call(base_url + "/v1/models", None, 10.0)
            models = body.get("data") or []
            if status == 200 and models and models[0].get("id"):
                return models[0]["id"]
            last = f"status {status}: {body}"
        except (urllib.error.URLError, OSError) as err:
            last = repr(err)
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    raise RuntimeError(f"/v1/models never listed a model: {last}")


def check_chat(base_url: str, model: str) -> str:
    """One greedy chat completion; returns a one-line summary or raises."""
    request = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in one word."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    status, body = call(base_url + "/v1/chat/completions", request, 120.0)
    if status != 200:
        raise RuntimeError(f"/v1/chat/completions answered {status}: {body}")
    choice = (body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = (message.get("content") or "") + (message.get("reasoning_content") or "")
    completion_tokens = (body.get("usage") or {}).get("completion_tokens", 0)
    if choice.get("finish_reason") not in ("stop", "length", "tool_calls") or completion_tokens < 1 or not text:
        raise RuntimeError(f"malformed chat completion: {body}")
    return f"model={model} finish_reason={choice['finish_reason']} completion_tokens={completion_tokens}"


def main() -> int:
    base_url = os.environ["OPENAI_BASE_URL"].rstrip("/")
    deadline = time.monotonic() + float(os.environ.get("SMOKE_TIMEOUT_S", "600"))
    try:
        model = wait_for_model(base_url, deadline)
        print("ok:", check_chat(base_url, model))
    except (RuntimeError, urllib.error.URLError, OSError) as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
