"""Decode graphs above 256 rows on the CPU side: the memory they keep (by hand), what the memory plan reserves for
them, and the host packing of a large bucket against the eager batch builder."""

from __future__ import annotations

import dataclasses

import numpy as np

from service.engine.config import EngineConfig, ModelConfig
from service.engine.distributed.step import StepPlan, StepRow
from service.engine.request import SamplingParams
from service.engine.runner.batch import build_forward_batch
from service.engine.runner.cuda_graph import (
    GRAPH_SLACK_BYTES,
    graph_buckets,
    graph_memory_bytes,
    layer_segments,
    pack_decode_inputs,
)
from service.engine.runner.memory_plan import graph_reserve_bytes
from service.testing.model_dir import published_config


def test_graph_memory_by_hand():
    # buckets 1, 2, 4 and 384: static logits 384 x 1000 fp32 = 1,536,000; transient 384 x 1000 x 6 = 2,304,000 + slack;
    # segment outputs (1 + 2 + 4 + 384) x 64 hidden x 2 tensors x 4 bytes x 3 segments = 600,576
    got = graph_memory_bytes((1, 2, 4, 384), vocab_size=1000, hidden_size=64, num_segments=3)
    assert got == 1_536_000 + 2_304_000 + GRAPH_SLACK_BYTES + 600_576


def test_graph_reserve_follows_the_buckets():
    """Nano at max_num_seqs 1024 reserves its logits at 1024 rows (512 MiB static + 768 MiB transient) and more than
    at 256; no graphs (cuda_graphs off, or the torch kernels) reserve nothing."""
    nano = ModelConfig.from_hf_dict(published_config("nano"))
    cfg = EngineConfig(model_path="x", device="cuda", kernel_backend="triton", max_num_seqs=1024)
    big = graph_reserve_bytes(cfg, nano)
    small = graph_reserve_bytes(dataclasses.replace(cfg, max_num_seqs=256), nano)
    segments = len(layer_segments(nano.num_layers))
    assert big == graph_memory_bytes(graph_buckets(1024), 131072, 2688, segments)
    assert big - GRAPH_SLACK_BYTES >= 1024 * 131072 * 10 > small
    assert graph_reserve_bytes(dataclasses.replace(cfg, cuda_graphs=False), nano) == 0
    assert graph_reserve_bytes(dataclasses.replace(cfg, kernel_backend="torch"), nano) == 0


def _decode_plan(num_rows: int, page_size: int, seed: int) -> StepPlan:
    """num_rows plain decode rows at random context lengths, distinct pages and slots."""
    rng = np.random.default_rng(seed)
    rows, next_page = [], 1
    for i in range(num_rows):
        prefix = int(rng.integers(1, 5 * page_size))
        pages = tuple(range(next_page, next_page + prefix // page_size + 1))
        next_page += len(pages)
        rows.append(StepRow(f"r{i}", prefix, 1, i + 1, pages, (int(rng.integers(3, 999)),), (), SamplingParams()))
    return StepPlan(tuple(rows))


def test_pack_decode_inputs_large_bucket_equals_batch_builder():
    """300 decode rows packed into bucket 384: the first 300 columns equal the eager builder's tensors, the 84 padding
    rows point at scratch slot 0 / page 0 with token 0 and prefix 0."""
    page = 4
    plan = _decode_plan(300, page, seed=3)
    bucket = next(b for b in graph_buckets(1024) if b >= 300)
    assert bucket == 384
    w = max(len(r.page_ids) for r in plan.rows)
    small = np.full((4, bucket), -7, dtype=np.int64)
    table = np.full((bucket, w), -7, dtype=np.int64)
    pack_decode_inputs(plan, page, small, table)
    ref = build_forward_batch(plan, page, 8, "cpu")
    assert small[0, :300].tolist() == ref.input_ids.tolist()
    assert small[1, :300].tolist() == ref.mamba.slot_ids.tolist()
    assert small[2, :300].tolist() == ref.attn.kv_slot_mapping.tolist()
    assert small[3, :300].tolist() == ref.attn.prefix_lens.tolist()
    for i, r in enumerate(plan.rows):
        assert table[i, : len(r.page_ids)].tolist() == list(r.page_ids)
    assert not small[:, 300:].any() and not table[300:].any()
