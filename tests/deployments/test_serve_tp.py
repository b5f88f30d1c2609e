"""`hybrid-serve serve --tp 2` on CPU: one engine replica whose two ranks are processes (gloo on 127.0.0.1) in a
placement group of two CPU bundles; its greedy completions equal the tp-1 replicas' of the shared app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
from ray import serve

from service.deployments.serve_cli import APP_NAME
from tests.deployments.serve_testkit import wait_until
from tests.deployments.test_serve_cli import _lines, _wait_for_line

PROMPTS = ("The capital of", "Count: 1 2 3", "<s> tool call")


def _greedy(client: openai.OpenAI, prompt: str) -> tuple[str, list[str]]:
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0.0, logprobs=1, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    return choice.text, list(choice.logprobs.tokens)


def test_serve_tp2_answers_like_tp1(cluster, main_app, tiny_model_path):
    tp1 = openai.OpenAI(base_url=main_app.base_url, api_key="none", timeout=60, max_retries=0)
    want = [_greedy(tp1, p) for p in PROMPTS]
    exe = Path(sys.executable).parent / "hybrid-serve"
    proc = subprocess.Popen(
        [
            str(exe),
            "serve",
            "--model-path",
            tiny_model_path,
            "--tp",
            "2",
            "--device",
            "cpu",
            "--replicas",
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(cluster.http_port),
        ],
        env={**os.environ, "RAY_ADDRESS": cluster.gcs_address},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_line(_lines(proc), "Press Ctrl-C", timeout_s=180)
        status = serve.status().applications[APP_NAME].deployments["engine"]
        assert status.status == "HEALTHY", status
        tp2 = openai.OpenAI(
            base_url=f"http://127.0.0.1:{cluster.http_port}/v1", api_key="none", timeout=60, max_retries=0
        )
        assert [_greedy(tp2, p) for p in PROMPTS] == want
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_until(lambda: APP_NAME not in serve.status().applications, timeout_s=30, what="the CLI's app to be removed")
