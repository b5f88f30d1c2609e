"""mamba_ssm_cache_dtype: the SSM state pools' element type (CPU). bf16 pools hold bf16 states, auto follows the
checkpoint's config.json, and with bf16 states on both sides the prefix cache still equals no cache: the states are
rounded at every chunk end (where snapshots are taken) and after every decode token, so a restored snapshot is the
state the uncached run carries through the same chunk end."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from service.engine import Engine
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.outputs import assert_same_outputs


def test_pools_follow_the_setting(mixed_ckpt, tmp_path):
    """auto reads the checkpoint (transformers' default float32 when it names none); an explicit value wins; a
    checkpoint value the engine cannot hold is refused, naming the setting."""
    assert make_engine(mixed_ckpt).runner.pools.ssm.dtype == torch.float32
    bf16 = make_engine(mixed_ckpt, mamba_ssm_cache_dtype="bfloat16").runner.pools
    assert bf16.ssm.dtype == torch.bfloat16 and bf16.conv.dtype == torch.float32
    ckpt = tmp_path / "ckpt"
    shutil.copytree(mixed_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "mamba_ssm_cache_dtype": "bfloat16"}))
    assert make_engine(str(ckpt)).runner.pools.ssm.dtype == torch.bfloat16
    assert make_engine(str(ckpt), mamba_ssm_cache_dtype="float32").runner.pools.ssm.dtype == torch.float32
    (ckpt / "config.json").write_text(json.dumps({**cfg, "mamba_ssm_cache_dtype": "float8"}))
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        make_engine(str(ckpt))


def _run(engine: Engine, waves: list[list[list[int]]], stagger: bool) -> list:
    """Runs each wave of prompts to the end (a later wave can hit what an earlier one published); stagger: one step
    after each request is added."""
    params = greedy(4, logprobs=True)
    ids, outs = [], {}
    for wave in waves:
        for p in wave:
            ids.append(engine.add_request(p, params))
            if stagger:
                outs.update((o.request_id, o) for o in engine.step() if o.finished)
        while engine.has_unfinished():
            outs.update((o.request_id, o) for o in engine.step() if o.finished)
    return [outs[i] for i in ids]


@pytest.mark.parametrize("stagger", [False, True])
def test_bf16_states_cache_equals_no_cache(mixed_ckpt, stagger):
    """Prompts sharing prefixes of 1-4 chunks (chunk 16), each prefilled in one step (token budget 4096), the
    second wave hitting what the first published: cache on and off, both with bf16 states, give the same tokens and
    logprobs."""
    prefixes = [random_ids(n, 100 + n) for n in (21, 66)]
    first = [prefixes[i] + random_ids(5 + i, 200 + i) for i in range(2)]
    second = [prefixes[i % 2] + random_ids(3 + 7 * i, 300 + i) for i in range(4)]
    common = dict(max_num_batched_tokens=4096, mamba_ssm_cache_dtype="bfloat16", debug_integrity=False)
    cached = make_engine(mixed_ckpt, mamba_cache_strategy="extra_buffer", max_mamba_snapshots=16, **common)
    off = make_engine(mixed_ckpt, **common)
    got, ref = _run(cached, [first, second], stagger), _run(off, [first, second], stagger)
    assert cached.stats()["prefix_cache_hit_tokens"] >= 16 + 64
    # bit-equal here (fp32 states too); without the chunk-end rounding the restored snapshots differ from the
    # uncached scan's states and the logprobs move by ~1e-5 on this model
    assert_same_outputs(got, ref, 2e-6)


def test_bf16_states_change_the_numbers(mixed_ckpt):
    """The setting takes effect: bf16 states give other logprobs than fp32 states (by ~2e-5 on this model: more
    than the cache test's tolerance)."""
    prompts = [[random_ids(70, 300 + i) for i in range(2)]]
    fp32 = _run(make_engine(mixed_ckpt, debug_integrity=False), prompts, False)
    bf16 = _run(make_engine(mixed_ckpt, mamba_ssm_cache_dtype="bfloat16", debug_integrity=False), prompts, False)
    worst = max(abs(a - b) for x, y in zip(fp32, bf16) for a, b in zip(x.logprobs, y.logprobs))
    assert worst > 5e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_states_on_the_gpu(mixed_ckpt):
    """The Triton kernels with bf16 states (decode graphs, the prefill scan's chunk-end rounding, the SSU store):
    cache on and off agree, and the pools hold bf16."""
    prefixes = [random_ids(n, 100 + n) for n in (21, 66)]
    first = [prefixes[i] + random_ids(5 + i, 200 + i) for i in range(2)]
    second = [prefixes[i % 2] + random_ids(3 + 7 * i, 300 + i) for i in range(4)]
    common = dict(
        device="cuda",
        kernel_backend="triton",
        dtype="float32",
        max_num_batched_tokens=4096,
        mamba_ssm_cache_dtype="bfloat16",
        debug_integrity=False,
    )
    cached = make_engine(mixed_ckpt, mamba_cache_strategy="extra_buffer", max_mamba_snapshots=16, **common)
    off = make_engine(mixed_ckpt, **common)
    assert cached.runner.pools.ssm.dtype == off.runner.pools.ssm.dtype == torch.bfloat16
    got, ref = _run(cached, [first, second], False), _run(off, [first, second], False)
    assert cached.stats()["prefix_cache_hit_tokens"] >= 16 + 64
    assert_same_outputs(got, ref, 1e-4)


@pytest.mark.parametrize("budget", [23, 40])
def test_bf16_states_do_not_depend_on_the_token_budget(mixed_ckpt, budget):
    """bf16 states are rounded where the scan ends a chunk and where a step ends a request's tokens: a prefill cut by
    a small token budget (23 or 40 tokens a step, chunk 16, three prompts in flight) ends its steps only at chunk
    ends, so it rounds where the uncut prefill does and gives the same tokens and logprobs."""
    prompts = [[random_ids(n, 500 + n) for n in (70, 45, 33)]]
    common = dict(mamba_ssm_cache_dtype="bfloat16", debug_integrity=False)
    whole_engine = make_engine(mixed_ckpt, max_num_batched_tokens=4096, **common)
    whole = _run(whole_engine, prompts, False)
    cut_engine = make_engine(mixed_ckpt, max_num_batched_tokens=budget, **common)
    cut = _run(cut_engine, prompts, False)
    assert cut_engine.num_steps > whole_engine.num_steps  # the prompts (148 tokens) were cut
    assert_same_outputs(cut, whole, 2e-6)
