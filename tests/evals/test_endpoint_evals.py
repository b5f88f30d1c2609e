"""Against a real `hybrid-serve serve` of the shipped model: `hybrid-serve eval` (openai client) and lm-eval's
local-chat-completions on the repo's hybrid_addition task. Slow: starts Ray Serve."""

from __future__ import annotations

import json
import os

import pytest

from service.cli import main as cli_main
from service.evals.cli import start_server, stop_server

TASKS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "service", "evals", "lm_eval_tasks")


@pytest.fixture(scope="module")
def endpoint(trained_model):
    proc, url = start_server(trained_model, "extra_buffer", ["--kernel-backend", "torch"])
    yield url
    stop_server(proc)


@pytest.mark.slow
def test_eval_cli_over_the_openai_api(endpoint, capsys):
    assert cli_main(["eval", "--base-url", endpoint, "--task", "addition,recall", "--num", "20"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("addition") and lines[1].startswith("recall")
    result = json.loads(lines[-1])["tasks"]
    assert result["addition"]["pass_at_1"] >= 0.9 and result["recall"]["pass_at_1"] >= 0.85, result
    assert result["addition"]["truncated"] == 0 and result["recall"]["no_answer"] == 0


@pytest.mark.slow
def test_lm_eval_local_chat_completions(endpoint):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model=tiny-trained,base_url={endpoint}/chat/completions,num_concurrent=4,max_retries=1",
        tasks=["hybrid_addition"],
        apply_chat_template=True,
        limit=20,
        task_manager=TaskManager(include_path=os.path.abspath(TASKS_DIR)),
    )
    assert out["results"]["hybrid_addition"]["exact_match,last_number"] >= 0.9, out["results"]


@pytest.mark.slow
def test_eval_ab_cli_against_a_running_endpoint(endpoint, capsys):
    assert cli_main(["eval", "--ab", "extra_buffer", "--ab-url", f"extra_buffer={endpoint}", "--ab-contexts", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert [line.split()[1] for line in lines[:3]] == ["addition", "recall", "state"]
    assert result["ab"]["extra_buffer"]["hit_ratio"] > 0.2 and result["identical_answers"] is True
    assert result["ab"]["extra_buffer"]["accuracy"]["addition"] >= 0.9
