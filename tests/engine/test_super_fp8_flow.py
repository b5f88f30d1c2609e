"""benchmarks/super_fp8.py's flow on CPU: the Super config shrunk to 2 layers of each kind (narrower, 8 experts), in
ModelOpt FP8 with an FP8 KV cache and dummy weights: load, decode at two batch sizes, a closed loop that keeps its
concurrency and finishes every request."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from benchmarks import super_fp8
from service.testing.model_dir import make_model_dir, published_config


def test_shrunk_overrides_keep_two_layers_of_each_kind():
    o = super_fp8.shrunk_overrides("super", 2, 8, 8)
    assert sorted(o["hybrid_override_pattern"]) == sorted("MMEE**")
    assert o["num_hidden_layers"] == 6 and o["n_routed_experts"] == 8 and o["num_experts_per_tok"] == 4
    assert o["hidden_size"] == published_config("super")["hidden_size"] // 8


@pytest.mark.slow  # 5-80 s on the shared 2-core machine (by its load); the FP8 KV engine tests run its parts by default
def test_super_fp8_flow_on_cpu(tmp_path):
    args = argparse.Namespace(
        config="super",
        device="cpu",
        gpu_memory_utilization=0.95,
        page_size=16,
        max_batched_tokens=128,
        decode_batches=[1, 2],
        prompt_len=16,
        decode_steps=2,
        isl=32,
        osl=4,
        prompts=3,
        max_concurrency=2,
        limit_s=math.inf,
        mamba_ssm_cache_dtype="auto",
        out=str(tmp_path / "report.md"),
    )
    model_dir = make_model_dir(
        str(tmp_path / "model"),
        "super",
        "fp8",
        kv_cache_fp8=True,
        overrides=super_fp8.shrunk_overrides("super", 2, 8, 8),
    )
    lines = super_fp8.run(args, model_dir)
    report = (tmp_path / "report.md").read_text()
    assert all(line in report for line in lines)
    assert re.search(r"float8_e4m3fn \d", lines[0]), lines[0]  # FP8 weights drawn
    assert any("torch.float8_e4m3fn; max_num_seqs 2" in line for line in lines)  # the FP8 KV pool
    assert any(line.startswith("decode B=2: ") for line in lines)
    loop = lines[-1]
    assert "concurrency reached 2.0" in loop and "requests finished 3.0" in loop, loop
