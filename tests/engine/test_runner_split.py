"""Split execution of a mixed step (plain decode rows in one forward, the rest in another) equals one forward.

On CPU the decode part runs as an eager forward of its own (graphs are CUDA-only); the partition, the ordering of
the sampled rows and the independence of the two parts are what is tested here. The oracle is the engine's own
single mixed forward on the same state (itself tested against transformers in test_parity.py)."""

from __future__ import annotations

import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.distributed.step import StepPlan, StepRow, sub_plan
from service.engine.runner.sampler import SamplerOutput
from service.engine.runner.split import restore_batch_order, split_step
from tests.outputs import assert_same_outputs


def _sched(*rows):
    """rows: (num_new_tokens, sample, snapshots, num_pages) -> a StepPlan of such rows."""
    return StepPlan(
        tuple(
            StepRow(f"r{i}", 0, n, 1, (1,) * pages, (0,) * n, snaps, SamplingParams() if s else None)
            for i, (n, s, snaps, pages) in enumerate(rows)
        )
    )


def test_split_partitions_in_batch_order():
    d, pre, chunk, snap, wide = (
        (1, True, (), 3),
        (9, True, (), 3),
        (9, False, (), 3),
        (1, True, ("s",), 3),
        (1, True, (), 9),
    )
    split = split_step(_sched(pre, d, chunk, d, snap, wide, d), max_batch=8, max_pages=8)
    assert split.graph_rows == (1, 3, 6)
    assert split.eager_rows == (0, 2, 4, 5)
    split = split_step(_sched(d, d, d, pre), max_batch=2, max_pages=8)  # the bucket limit
    assert split.graph_rows == (0, 1) and split.eager_rows == (2, 3)
    assert split_step(_sched(pre, chunk), 8, 8).graph_rows == ()


def test_restore_batch_order():
    assert restore_batch_order(["a", "b", "c"], [0, 2, 5]) == ["a", "b", "c"]
    assert restore_batch_order(["d1", "d3", "p0", "p2"], [1, 3, 0, 2]) == ["p0", "d1", "p2", "d3"]


def _pool_state(runner) -> list[torch.Tensor]:
    return [runner.pools.kv.clone(), runner.pools.conv.clone(), runner.pools.ssm.clone()]


def _set_pool_state(runner, state: list[torch.Tensor]) -> None:
    for dst, src in zip((runner.pools.kv, runner.pools.conv, runner.pools.ssm), state):
        dst.copy_(src)


def _checking_execute(runner, stats: dict):
    """An execute that runs each step twice from the same state, one forward vs split, compares logits and the
    state pools after the step, then keeps the split result (greedy)."""

    def execute(plan):
        runner._apply_slot_ops(plan)
        before = _pool_state(runner)
        one_logits, one_rows = runner.forward(plan, None)
        after_one = _pool_state(runner)
        _set_pool_state(runner, before)
        split = runner._split(plan)
        split_logits, split_rows = runner.forward(plan, split)
        if split is not None and split.eager_rows:
            stats["mixed"] += 1
        assert sorted(split_rows) == one_rows
        by_row = dict(zip(split_rows, split_logits))
        torch.testing.assert_close(torch.stack([by_row[r] for r in one_rows]), one_logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(_pool_state(runner), after_one):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        tokens = torch.argmax(split_logits, dim=-1).tolist()
        return SamplerOutput(restore_batch_order(tokens, split_rows), None, None)

    return execute


def _engine(path: str, async_scheduling: bool = True) -> Engine:
    engine = Engine(
        EngineConfig(
            model_path=path,
            device="cpu",
            kernel_backend="torch",
            dtype="float32",
            page_size=4,
            max_num_seqs=6,
            max_num_batched_tokens=24,
            async_scheduling=async_scheduling,
        )
    )
    engine.runner.split_steps = True
    return engine


def _prompts(engine: Engine, lens, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist() for n in lens]


def test_split_step_equals_one_forward(tiny_model_dir):
    """Prefill chunks arrive while others decode: every step's logits and state pools match one forward."""
    engine = _engine(tiny_model_dir, async_scheduling=False)  # every step through `execute`
    stats = {"mixed": 0}
    engine.runner.execute = _checking_execute(engine.runner, stats)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    waves = [_prompts(engine, (5, 30), 0), _prompts(engine, (17, 3, 41), 1)]
    for prompt in waves[0]:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            for prompt in waves[1]:
                engine.add_request(prompt, params)
        assert steps < 200
    assert stats["mixed"] >= 3, stats


def test_split_generate_matches_unsplit(tiny_model_dir):
    """End to end: seeded sampling and greedy logprobs are the same with and without the split."""
    outs = []
    for split in (False, True):
        engine = _engine(tiny_model_dir)
        engine.runner.split_steps = split
        prompts = _prompts(engine, (33, 4, 12, 27, 9), 2)
        params = [
            SamplingParams(max_tokens=8, temperature=0.8, seed=100 + i, ignore_eos=True, logprobs=True)
            for i in range(len(prompts))
        ]
        outs.append(engine.generate(prompts, params))
        assert (engine.runner.num_split_steps >= 2) if split else (engine.runner.num_split_steps == 0)
    assert_same_outputs(outs[0], outs[1], 1e-4)


def test_sub_plan_keeps_the_whole_step():
    plan = _sched((1, True, (), 1), (4, True, (), 1))
    assert sub_plan(plan, (0, 1)) is plan
    assert sub_plan(plan, (1,)).rows == plan.rows[1:]
