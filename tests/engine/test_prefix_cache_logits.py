"""Prefix cache, logits level: outputs with the cache equal outputs without it (docs/design.md: Prefix cache, Testing)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine import Engine, EngineConfig
from tests.engine.helpers import greedy, make_engine, random_ids
from tests.outputs import assert_same_outputs

N_EXAMPLES = int(os.environ.get("HYBRID_SERVE_HYPOTHESIS_EXAMPLES", "200"))


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    """chunk size -> (checkpoint path, loaded model shared by every engine)."""
    out = {}
    for variant, c in (("mixed_g2_c16", 16), ("attn_first_c8", 8)):
        path = hf_checkpoints[variant]
        out[c] = (path, make_engine(path).runner.model)
    return out


@pytest.fixture(scope="module")
def off_engines(models):
    return {
        c: Engine(
            EngineConfig(
                model_path=p, device="cpu", mamba_cache_strategy="off", page_size=4, max_num_batched_tokens=4096
            ),
            model=m,
        )
        for c, (p, m) in models.items()
    }


workload = st.fixed_dictionaries(
    {
        "chunk": st.sampled_from([8, 16]),
        "page": st.sampled_from([1, 4, 16]),
        "strategy": st.sampled_from(["extra_buffer", "extra_buffer", "no_buffer"]),
        "prefixes": st.lists(st.integers(1, 80), min_size=1, max_size=2),
        "requests": st.lists(
            st.tuples(st.integers(0, 1), st.integers(1, 20), st.integers(1, 6)), min_size=2, max_size=6
        ),
        "budget": st.sampled_from([5, 13, 64, 512]),
        "max_seqs": st.integers(1, 4),
        "kv_pages": st.sampled_from([None, 48, 96]),
        "snapshots": st.integers(1, 6),
        "stagger": st.booleans(),
        "seed": st.integers(0, 10_000),
    }
)


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(w=workload)
def test_cache_equals_no_cache(models, off_engines, w):
    path, model = models[w["chunk"]]
    page = 1 if w["strategy"] == "no_buffer" else w["page"]
    kv_pages = None if w["kv_pages"] is None else w["kv_pages"] * 16 // page
    engine = Engine(
        EngineConfig(
            model_path=path,
            device="cpu",
            page_size=page,
            mamba_cache_strategy=w["strategy"],
            max_num_batched_tokens=w["budget"],
            max_num_seqs=w["max_seqs"],
            num_kv_pages=kv_pages,
            max_mamba_snapshots=w["snapshots"],
            debug_integrity=True,
        ),
        model=model,
    )
    prefixes = [random_ids(n, w["seed"] + i) for i, n in enumerate(w["prefixes"])]
    prompts = [
        prefixes[p % len(prefixes)] + random_ids(n, w["seed"] * 31 + j) for j, (p, n, _) in enumerate(w["requests"])
    ]
    params = [greedy(m, logprobs=True) for _, _, m in w["requests"]]
    ids, outs = [], {}

    def step() -> None:
        outs.update((o.request_id, o) for o in engine.step() if o.finished)

    for prompt, sp in zip(prompts, params):
        ids.append(engine.add_request(prompt, sp))
        if w["stagger"]:
            step()
    while engine.has_unfinished():
        step()
    engine.check_integrity()
    ref = off_engines[w["chunk"]].generate(prompts, params)
    assert_same_outputs([outs[rid] for rid in ids], ref, 1e-4)


def test_multi_turn_chat_hits_grid_aligned_prefix(mixed_ckpt):
    engine = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="extra_buffer", max_mamba_snapshots=32)
    grid = engine.cache.grid
    convo = random_ids(37, 40)
    hit, reusable, prev_computed = 0, 0, 0
    for turn in range(6):
        out = engine.generate([convo], greedy(23))[0]
        if turn > 0:
            hit += out.num_cached_tokens
            reusable += (min(prev_computed, len(convo) - 1) // grid) * grid
        prev_computed = len(convo) + len(out.token_ids) - 1
        convo = convo + out.token_ids + random_ids(19, 41 + turn)
    assert reusable > 0 and hit / reusable >= 0.9, (hit, reusable)
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] == hit and s["mamba_snapshot_misses"] == 0
    cold = engine.generate([random_ids(50, 99)], greedy(2))[0]
    assert cold.num_cached_tokens == 0 and engine.stats()["mamba_snapshot_misses"] == 0


def test_pressure_small_pools_many_requests(mixed_ckpt):
    engine = make_engine(
        mixed_ckpt,
        page_size=4,
        mamba_cache_strategy="extra_buffer",
        max_num_seqs=3,
        num_kv_pages=3 * 24,
        max_mamba_snapshots=3,
        max_num_batched_tokens=48,
    )
    off = make_engine(mixed_ckpt, page_size=4, mamba_cache_strategy="off", max_num_batched_tokens=512)
    prefixes = [random_ids(20 + 7 * i, 50 + i) for i in range(4)]
    prompts = [prefixes[(i // 5) % 4] + random_ids(3 + i % 11, 60 + i) for i in range(50)]  # bursts of 5
    outs = engine.generate(prompts, greedy(5))  # debug_integrity: check_integrity after every step
    ref = off.generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] > 0 and s["cache_evictions_kv"] > 0 and s["cache_evictions_mamba"] > 0
