"""CUDA-graph decode: replayed steps give the same greedy tokens as eager steps (GPU), and the routing rules (CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.distributed.step import StepPlan, StepRow
from service.engine.runner.batch import build_forward_batch
from service.engine.runner.cuda_graph import (
    BATCH_BUCKETS,
    LARGE_BUCKET_STEP,
    graph_buckets,
    is_graphable,
    layer_segments,
)
from tests.marks import needs_cuda
from tests.outputs import assert_same_outputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sched(*rows):
    """rows: (num_new_tokens, sample, snapshots, num_pages) -> a StepPlan of such rows."""
    return StepPlan(
        tuple(
            StepRow(f"r{i}", 0, n, 1, (1,) * pages, (0,) * n, snaps, SamplingParams() if s else None)
            for i, (n, s, snaps, pages) in enumerate(rows)
        )
    )


def test_buckets_cover_max_num_seqs():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(5) == (1, 2, 4, 8)
    assert graph_buckets(256) == BATCH_BUCKETS
    assert graph_buckets(300) == BATCH_BUCKETS + (300,)
    assert graph_buckets(1024) == BATCH_BUCKETS + (384, 512, 640, 768, 896, 1024)
    assert graph_buckets(1000) == BATCH_BUCKETS + (384, 512, 640, 768, 896, 1000)


def test_every_batch_up_to_max_num_seqs_has_a_bucket():
    """Each batch size B <= max_num_seqs replays the smallest bucket >= B: at most twice B up to 256, at most 127
    padding rows above; no bucket exceeds max_num_seqs past the power of two that first holds it."""
    for max_seqs in (3, 64, 200, 256, 257, 700, 1024):
        buckets = graph_buckets(max_seqs)
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] >= max_seqs
        assert buckets[-1] == max_seqs or buckets[-1] <= 256
        for b in range(1, max_seqs + 1):
            bucket = next(x for x in buckets if x >= b)
            assert bucket < 2 * b if b <= 256 else bucket - b < LARGE_BUCKET_STEP, (max_seqs, b, bucket)


def test_layer_segments_cover_every_layer_once():
    for n in (1, 2, 3, 9, 52, 88):
        seg = layer_segments(n)
        assert seg[0][0] == 0 and seg[-1][1] == n
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(seg, seg[1:]))
    assert layer_segments(52) == ((0, 2), (2, 6), (6, 14), (14, 30), (30, 52))


def test_segmented_forward_equals_forward(tiny_model_dir):
    """The graph runner captures embed -> run_layers per segment -> logits: on real decode inputs the pieces give
    exactly the model's forward (CPU, fp32, state pools restored between the two runs)."""
    eng = Engine(
        EngineConfig(model_path=tiny_model_dir, device="cpu", mamba_cache_strategy="off", page_size=4, max_num_seqs=4)
    )
    eng.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    ids = [
        eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        for p in ([3, 4, 5, 6, 7], [8, 9, 10])
    ]
    for _ in range(3):
        eng.step()
    sched = eng.scheduler.schedule()
    batch = build_forward_batch(sched.plan, 4, eng.model_config.chunk_size, eng.runner.device)
    assert batch.mamba.decode_only
    m, p = eng.runner.model, eng.runner.pools
    saved = [t.clone() for t in (p.kv, p.conv, p.ssm)]
    whole = m(batch.input_ids, batch.attn, batch.mamba, batch.logits_indices, p.kv, p.conv, p.ssm)
    for dst, src in zip((p.kv, p.conv, p.ssm), saved):
        dst.copy_(src)
    with torch.inference_mode():
        x, h = m.embed(batch.input_ids)
        for start, end in layer_segments(len(m.backbone.layers), first=1):
            x, h = m.run_layers(x, h, start, end, batch.attn, batch.mamba, p.kv, p.conv, p.ssm)
        pieces = m.logits(x, batch.logits_indices)
        static = torch.full_like(pieces, float("nan"))  # the graphs' shared logits buffer is written in place
        written = m.logits(x, batch.logits_indices, out=static)
    assert torch.equal(whole, pieces) and written is static and torch.equal(static, pieces)
    for i in ids:
        eng.abort(i)


def test_only_plain_decode_steps_are_replayed():
    decode = (1, True, (), 3)
    assert is_graphable(_sched(decode, decode), max_batch=4, max_pages=8)
    assert not is_graphable(_sched(decode, (5, True, (), 3)), 4, 8)  # a prefill row
    assert not is_graphable(_sched(decode, (1, False, (), 3)), 4, 8)  # a row not sampled
    assert not is_graphable(_sched(decode, (1, True, ("snap",), 3)), 4, 8)  # a snapshot this step
    assert not is_graphable(_sched(*[decode] * 5), 4, 8)  # larger than the largest bucket
    assert not is_graphable(_sched(decode, (1, True, (), 9)), 4, 8)  # wider than the static page table
    assert not is_graphable(_sched(), 4, 8)


def test_cpu_ignores_the_flag(tiny_model_dir):
    engine = Engine(EngineConfig(model_path=tiny_model_dir, device="cpu", cuda_graphs=True, max_num_seqs=4))
    assert engine.runner.graphs is None


def _generate(path: str, graphs: bool, prompt_lens, max_tokens: int, model=None, **cfg):
    engine = Engine(
        EngineConfig(model_path=path, device="cuda", kernel_backend="triton", cuda_graphs=graphs, **cfg), model=model
    )
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    outs = engine.generate(prompts, params)
    replays = engine.runner.graphs.num_replays if engine.runner.graphs is not None else 0
    return outs, replays


def _assert_same(eager, graphed, logprob_tol: float) -> None:
    assert_same_outputs(graphed, eager, logprob_tol)


@pytest.mark.gpu
@needs_cuda
def test_graph_decode_equals_eager_tiny(tiny_model_dir):
    """5 requests of different lengths (bucket 8 with 3 padding rows, then smaller buckets as they finish)."""
    lens, cfg = (
        (35, 7, 16, 33, 64),
        dict(dtype="float32", mamba_cache_strategy="off", page_size=4, max_num_seqs=8, max_num_batched_tokens=64),
    )
    eager, n0 = _generate(tiny_model_dir, False, lens, 20, **cfg)
    graphed, n1 = _generate(tiny_model_dir, True, lens, 20, **cfg)
    assert n0 == 0 and n1 >= 15, n1
    _assert_same(eager, graphed, 1e-3)


@pytest.mark.gpu
@needs_cuda
def test_graph_decode_equals_eager_nano_slice(tmp_path):
    """A random Nano-30B-A3B-shaped slice (mamba, attention, MoE layers), fp32, dummy weights (the same seed in
    both engines, so the same weights)."""
    from service.testing.model_dir import published_config

    config = published_config("nano")
    config.update(hybrid_override_pattern="M*E", num_hidden_layers=3)
    with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    cfg = dict(
        dtype="float32",
        mamba_cache_strategy="off",
        page_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=512,
        max_model_len=512,
        load_format="dummy",
    )
    lens = (100, 37, 250)
    eager, _ = _generate(str(tmp_path), False, lens, 12, **cfg)
    graphed, n = _generate(str(tmp_path), True, lens, 12, **cfg)
    assert n >= 10, n
    _assert_same(eager, graphed, 1e-3)


def _generate_staggered(path: str, graphs: bool, waves, max_tokens: int, **cfg):
    """waves: prompt-length tuples; wave k is added after k*3 engine steps (prefills arrive while others decode).
    Returns the greedy outputs in order of addition and the runner (for its counters)."""
    engine = Engine(EngineConfig(model_path=path, device="cuda", kernel_backend="triton", cuda_graphs=graphs, **cfg))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    ids, final, steps = [], {}, 0
    while len(ids) < sum(map(len, waves)) or engine.has_unfinished():
        if steps % 3 == 0 and steps // 3 < len(waves):
            ids += [
                engine.add_request(torch.randint(3, vocab, (n,), generator=g).tolist(), params)
                for n in waves[steps // 3]
            ]
        final.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        assert steps < 2000
    return [final[i] for i in ids], engine.runner


@pytest.mark.gpu
@needs_cuda
def test_mixed_steps_split_equals_eager_tiny(tiny_model_dir):
    """Mixed steps (long prompts prefilled in chunks, new prompts arriving while others decode) run their plain
    decode rows from a graph and the rest eagerly: same greedy tokens (logprobs within 1e-3) as all-eager."""
    waves = ((6, 150), (9, 3, 200), (40,), (120, 5))
    cfg = dict(dtype="float32", mamba_cache_strategy="off", page_size=4, max_num_seqs=8, max_num_batched_tokens=48)
    eager, r0 = _generate_staggered(tiny_model_dir, False, waves, 24, **cfg)
    graphed, r1 = _generate_staggered(tiny_model_dir, True, waves, 24, **cfg)
    assert r0.num_split_steps == 0 and r1.num_split_steps >= 5, r1.num_split_steps
    assert r1.graphs.num_replays >= 20 + r1.num_split_steps, r1.graphs.num_replays
    _assert_same(eager, graphed, 1e-3)


@pytest.mark.gpu
@needs_cuda
def test_graph_decode_above_256_equals_eager_tiny(tiny_model_dir):
    """300 requests decoding together (max_num_seqs 520: buckets ..., 256, 384, 512, 520): their decode steps replay
    bucket 384 with 84 padding rows and give the eager steps' tokens and logprobs."""
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(5, 40, (300,), generator=g).tolist()
    cfg = dict(dtype="float32", mamba_cache_strategy="off", page_size=4, max_num_seqs=520, max_num_batched_tokens=16384)
    eager, n0 = _generate(tiny_model_dir, False, lens, 6, **cfg)
    graphed, n1 = _generate(tiny_model_dir, True, lens, 6, **cfg)
    assert n0 == 0 and n1 >= 4, n1
    _assert_same(eager, graphed, 1e-3)


@pytest.mark.gpu
@needs_cuda
def test_graph_memory_stays_within_the_plan(tmp_path):
    """A Nano slice with max_num_seqs 1024 (buckets up to 1024, Nano's 131072-token vocabulary): what the captured
    graphs keep is at most what the memory plan reserved for them."""
    from service.testing.model_dir import published_config

    config = published_config("nano")
    config.update(hybrid_override_pattern="M*E", num_hidden_layers=3)
    with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    engine = Engine(
        EngineConfig(
            model_path=str(tmp_path),
            device="cuda",
            dtype="bfloat16",
            load_format="dummy",
            mamba_cache_strategy="off",
            max_num_seqs=1024,
            max_model_len=1024,
            page_size=64,
            gpu_memory_utilization=0.3,
        )
    )
    graphs, plan = engine.runner.graphs, engine.runner.memory_plan
    assert graphs.buckets[-1] == 1024 and plan is not None
    assert 1024 * 131072 * 4 <= graphs.captured_bytes <= plan.graph_bytes, (graphs.captured_bytes, plan.graph_bytes)
