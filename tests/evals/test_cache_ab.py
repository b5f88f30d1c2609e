"""Cache A/B on the trained model, in process: every strategy answers the cache-stressing workload identically
(greedy), and SGLang's snapshot-offset bug, re-injected, lowers the state task's accuracy."""
from __future__ import annotations

import asyncio

import pytest
import torch

import service.engine.runner.batch as batch_mod
from cache_helpers import buggy_snapshot_chunk_indices
from service.engine import Engine, EngineConfig
from service.evals.ab import ab_rounds, run_ab
from service.evals.harness import EngineBackend

NUM_CONTEXTS = 4


def _engine(path: str, strategy: str) -> Engine:
    torch.set_num_threads(2)
    return Engine(EngineConfig(model_path=path, kernel_backend="torch", mamba_cache_strategy=strategy,
                               page_size=1 if strategy == "no_buffer" else 16, max_num_seqs=64,
                               max_num_batched_tokens=4096))


def test_workload_shape():
    rounds = ab_rounds(NUM_CONTEXTS)
    assert [len(r) for r in rounds] == [3 * NUM_CONTEXTS] * 3
    first, second = rounds[0][0], rounds[1][0]
    # round 2 asks a new question about round 1's context: the user turn shares the whole context
    assert first.messages[0]["content"].rsplit("\n", 1)[0] == second.messages[0]["content"].rsplit("\n", 1)[0]
    assert len(rounds[2][0].messages) == 3 and rounds[2][0].messages[1]["role"] == "assistant"


@pytest.fixture(scope="module")
def ab_results(trained_model):
    backends = {s: EngineBackend(_engine(trained_model, s)) for s in ("off", "no_buffer", "extra_buffer")}
    return {r.strategy: r for r in asyncio.run(run_ab(backends, NUM_CONTEXTS))}


def test_strategies_answer_identically(ab_results):
    off = ab_results["off"]
    for strategy in ("no_buffer", "extra_buffer"):
        assert ab_results[strategy].answers == off.answers, strategy
        assert ab_results[strategy].hit_ratio > 0.3, (strategy, ab_results[strategy].hit_ratio)
    assert off.hit_ratio == 0.0
    for row in (row for r in ab_results.values() for row in r.rows()):
        print(row)
    assert off.scores["recall"].pass_at_1 >= 0.75 and off.scores["addition"].pass_at_1 >= 0.9


def test_reinjected_snapshot_offset_bug_lowers_state_accuracy(ab_results, trained_model, monkeypatch):
    monkeypatch.setattr(batch_mod, "snapshot_chunk_indices", buggy_snapshot_chunk_indices)
    (buggy,) = asyncio.run(run_ab({"extra_buffer": EngineBackend(_engine(trained_model, "extra_buffer"))},
                                  NUM_CONTEXTS))
    good = ab_results["extra_buffer"]
    print("state accuracy: correct offsets", good.scores["state"].pass_at_1, "seed bug", buggy.scores["state"].pass_at_1)
    print("recall accuracy: correct offsets", good.scores["recall"].pass_at_1, "seed bug",
          buggy.scores["recall"].pass_at_1)
    assert buggy.hit_ratio > 0.3
    assert buggy.scores["state"].pass_at_1 <= good.scores["state"].pass_at_1 - 0.2
