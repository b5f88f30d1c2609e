"""Logits parity against transformers' NemotronHForCausalLM (the oracle) on tiny random checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.engine.kernels import cpu_native_ops
from tests.engine.helpers import full_prefill_logits, greedy, make_engine, random_ids
from tests.outputs import Expected, assert_same_outputs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_models(hf_checkpoints):
    return {
        v: transformers.NemotronHForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
        for v, p in hf_checkpoints.items()
    }


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> Expected:
    """transformers' greedy continuation of ids (eos ignored): its tokens and each token's logprob."""
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    tokens = ref.sequences[0, len(ids) :].tolist()
    return Expected(tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(ref.scores, tokens)])


@pytest.mark.parametrize("variant", ["mixed_g2_c16", "latent_g1_c8", "attn_first_c8"])
def test_prefill_logits_match_transformers(variant, hf_checkpoints, hf_models):
    engine = make_engine(hf_checkpoints[variant])
    C = engine.model_config.chunk_size
    for L in (1, C - 1, C, C + 1, 3 * C + 5):
        ids = random_ids(L, seed=L)
        with torch.no_grad():
            ref = hf_models[variant](torch.tensor([ids])).logits[0].float()
        ours = full_prefill_logits(engine, ids)
        rel = ((ours - ref).abs().max() / ref.abs().max()).item()
        assert rel <= 1e-4, f"{variant} L={L}: max relative logits error {rel:.2e}"


@pytest.mark.parametrize(
    "variant, rows_from, moe_rows",  # ME*M-E: MLP + MoE after a Mamba layer; M-*E: attention + MoE
    [("latent_g1_c8", 4, ["T", "R"]), ("attn_tail_c8", 2, ["R"])],
)
def test_trailing_layers_run_on_the_logits_rows_alone(variant, rows_from, moe_rows, hf_checkpoints, hf_models):
    """With fewer logits rows than tokens, the trailing MoE / MLP layers run on those rows alone (and an attention
    layer before them attends from those rows alone, after writing every row's K/V): the logits equal transformers'
    at those positions and the engine's all-rows forward (the decode steps after such a prefill, which read the
    last attention layer's K/V of every prompt token: test_greedy_continuation_matches_transformers)."""
    engine = make_engine(hf_checkpoints[variant])
    model = engine.runner.model
    assert model.rows_from == rows_from
    ids = random_ids(3 * engine.model_config.chunk_size + 5, seed=11)
    rows = torch.tensor([0, 7, len(ids) - 1])
    seen = []  # rows of each MoE call
    kernels = model.kernels

    def counted(x, *args, **kwargs):
        seen.append(x.shape[0])
        return kernels.moe_experts(x, *args, **kwargs)

    model.kernels = dataclasses.replace(kernels, moe_experts=counted)
    try:
        ours = full_prefill_logits(engine, ids, rows)
    finally:
        model.kernels = kernels
    assert seen == [{"T": len(ids), "R": len(rows)}[m] for m in moe_rows]
    with torch.no_grad():
        ref = hf_models[variant](torch.tensor([ids])).logits[0, rows].float()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    torch.testing.assert_close(ours, full_prefill_logits(engine, ids)[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["mixed_g2_c16", "latent_g1_c8", "attn_first_c8", "attn_tail_c8"])
def test_greedy_continuation_matches_transformers(variant, hf_checkpoints, hf_models):
    engine = make_engine(hf_checkpoints[variant])
    C = engine.model_config.chunk_size
    ids = random_ids(2 * C + 3, seed=7)
    out = engine.generate([ids], greedy(32, logprobs=True))[0]
    assert_same_outputs(out, hf_greedy(hf_models[variant], ids, 32), 1e-4)


@pytest.mark.parametrize("variant", ["mixed_g2_c16", "attn_first_c8"])
def test_native_backend_batch_matches_transformers(variant, hf_checkpoints, hf_models):
    """kernel_backend='native' (compiled CPU decode kernels): a batch of prompts of different lengths, decoded
    together (several rows per decode step, each at its own context length), gives transformers' greedy tokens and
    logprobs for each prompt."""
    engine = make_engine(hf_checkpoints[variant], kernel_backend="native")
    assert engine.runner.model.kernels.name == "native"
    for block in engine.runner.model.backbone.layers:  # the experts laid out for the kernel (E = 8, I = 32, d = 64)
        if hasattr(block.mixer, "experts"):
            assert cpu_native_ops._native_moe_layout(block.mixer.experts.up_proj, block.mixer.experts.down_proj)
    C = engine.model_config.chunk_size
    prompts = [random_ids(n, seed=20 + n) for n in (C + 3, 2 * C, 5)]
    outs = engine.generate(prompts, greedy(12, logprobs=True))
    assert_same_outputs(outs, [hf_greedy(hf_models[variant], ids, 12) for ids in prompts], 1e-4)
