"""The engine with kernel_backend="triton" vs "torch" on the tiny NemotronH checkpoint."""

from __future__ import annotations

import pytest
import torch

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.kernels import get_kernels, torch_reference_kernels
from service.engine.kernels.triton_backend import TORCH_REFERENCE_OPS
from service.testing.tiny import make_tiny_model
from tests.kernels.triton_test_util import DEVICE, gpu, needs_cuda
from tests.outputs import assert_same_outputs

# prompt lengths vs chunk 16 / page 4: unaligned first request, < C, = C, k*C +- 1
PROMPT_LENS = (35, 7, 16, 33)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_triton")), seed=3)


def _run(path: str, backend: str, dtype: str, max_tokens: int) -> list:
    engine = Engine(
        EngineConfig(
            model_path=path,
            device=DEVICE,
            dtype=dtype,
            mamba_cache_strategy="off",
            page_size=4,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            kernel_backend=backend,
        )
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in PROMPT_LENS]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    return engine.generate(prompts, params)


def test_bundle_names_its_torch_reference_ops():
    k = get_kernels("triton")
    ref = get_kernels("torch")
    assert k.name == "triton"
    for field in (
        "ssd_varlen",
        "selective_state_update",
        "conv_varlen",
        "conv_update",
        "paged_attention",
        "moe_experts",
        "rms_norm",
        "gated_rms_norm",
    ):
        assert getattr(k, field) is not getattr(ref, field), field
    oracle = torch_reference_kernels()
    for field in TORCH_REFERENCE_OPS:
        assert getattr(k, field) is getattr(oracle, field), field


def _compare(path: str, dtype: str, max_tokens: int, logprob_tol: float) -> None:
    ref = _run(path, "torch", dtype, max_tokens)
    out = _run(path, "triton", dtype, max_tokens)
    assert_same_outputs(out, ref, logprob_tol)


def test_engine_triton_equals_torch_fp32(tiny_dir):
    """Chunked prefill across steps (budget 64 < sum of prompts), then decode, greedy: same tokens. Three tokens
    give every kind of step: prefill only, prefill of the last prompt mixed with decodes, decode of all four, and
    decode of one."""
    _compare(tiny_dir, "float32", max_tokens=3, logprob_tol=1e-4)


@gpu
@needs_cuda
def test_engine_triton_equals_torch_gpu(tiny_dir):
    _compare(tiny_dir, "float32", max_tokens=24, logprob_tol=1e-3)


@gpu
@needs_cuda
def test_engine_triton_bf16_prefill_logits_gpu(tiny_dir):
    ref = _run(tiny_dir, "torch", "bfloat16", 1)
    out = _run(tiny_dir, "triton", "bfloat16", 1)
    diffs = [abs(o.logprobs[0] - r.logprobs[0]) for r, o in zip(ref, out)]
    agree = sum(o.token_ids == r.token_ids for r, o in zip(ref, out))
    assert max(diffs) <= 5e-2 and agree >= len(PROMPT_LENS) - 1, (diffs, agree)
