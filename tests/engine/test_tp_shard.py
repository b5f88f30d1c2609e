"""Tensor / expert parallel sharding of NemotronH (CPU, gloo): a model split over tp ranks computes what the tp-1
model computes, and each rank holds and reads only its slices.

The oracle is the tp-1 model, itself checked against transformers (test_parity.py; the bias variant below).
Checkpoints: the embedded tiny model (n_groups 2: groups split at tp 2, replicated at tp 4), transformers'
`latent_g1_c8` (latent MoE, n_groups 1: replicated everywhere) and `bias_latent_g4` (biases on every linear, latent
MoE, n_groups 4 split at tp 2 and 4, vocabulary 250 that tp 4 does not divide). One spawn of 4 ranks runs tp 2
(ranks 0-1) and tp 4, each with ep = 1 and ep = tp, on all three; the tests read its per-rank reports."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.engine.config import ModelConfig
from service.engine.distributed.parallel import ParallelContext, check_shardable, rank_shapes, working_sizes
from service.engine.kernels import get_kernels
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.model.weights import load_weights
from tests.engine import tp_ranks
from tests.engine.helpers import full_prefill_logits, make_engine, random_ids

CHECKPOINTS = ("tiny", "latent_g1_c8", "bias_latent_g4")
TOL = 1e-5


@pytest.fixture(scope="module")
def tp_paths(tiny_model_dir, hf_checkpoints) -> dict[str, str]:
    return {
        "tiny": tiny_model_dir,
        "latent_g1_c8": hf_checkpoints["latent_g1_c8"],
        "bias_latent_g4": hf_checkpoints["bias_latent_g4"],
    }


@pytest.fixture(scope="module")
def tp_runs(tp_paths, tmp_path_factory) -> dict[int, list[dict]]:
    """tp -> per-rank {checkpoint: {check: max abs difference to tp 1}} for ep = 1 and ep = tp, tp 2 and 4, from one
    spawn of 4 ranks (tp 2 runs on ranks 0 and 1 in their own process group)."""
    out = tmp_path_factory.mktemp("tp")
    tp_ranks.spawn(tp_ranks.report, 4, tp_paths, (2, 4), str(out))
    reports = []
    for r in range(4):
        with open(out / f"rank{r}.json") as f:
            reports.append(json.load(f))
    return {tp: [rep[str(tp)] for rep in reports[:tp]] for tp in (2, 4)}


@pytest.fixture(params=[2, 4], ids=lambda tp: f"tp{tp}")
def tp_reports(request, tp_runs) -> tuple[int, list[dict]]:
    return request.param, tp_runs[request.param]


def _checks(reports: list[dict], ckpt: str, prefix: str) -> dict[str, float]:
    """check -> worst over the ranks, for checks starting with prefix."""
    return {k: max(rep[ckpt][k] for rep in reports) for k in reports[0][ckpt] if k.startswith(prefix)}


@pytest.mark.parametrize("ckpt", CHECKPOINTS)
@pytest.mark.parametrize("ep_is_tp", [False, True], ids=["ep1", "ep=tp"])
def test_sharded_model_matches_tp1(tp_reports, ckpt, ep_is_tp):
    """Full forwards over a packed batch (mixed prompt lengths, a chunked prefill, a mixed step, a decode step):
    fp32 logits and log-probs within 1e-5 of tp 1 on every rank, identical greedy tokens, and each rank's KV / conv /
    SSM pools equal to its slice of the tp-1 pools (its KV heads, x/B/C channels and Mamba heads only); one forward
    makes one all-reduce per layer (MoE included) and for the embedding, plus one per Mamba layer whose norm groups
    span ranks, and one all-gather of the logits."""
    tp, reports = tp_reports
    ep = tp if ep_is_tp else 1
    got = {k.split("/")[1]: v for k, v in _checks(reports, ckpt, f"ep{ep}/").items()}
    assert got["argmax"] == 0 and got["collectives"] == 0, got
    assert got["logits"] <= TOL and got["logprobs"] <= TOL, got
    assert max(got["kv"], got["conv"], got["ssm"]) <= TOL, got


@pytest.mark.parametrize("letter", ["embed", "M", "*", "E", "-"])
def test_each_sharded_layer_matches_tp1(tp_reports, letter):
    """Run one layer at a time: the residual stream after the vocab-parallel embedding and after every Mamba,
    attention, MoE and MLP layer equals tp 1's, on every checkpoint, rank and ep."""
    _, reports = tp_reports
    seen = 0
    for ckpt in CHECKPOINTS:
        for check, err in _checks(reports, ckpt, "ep").items():
            layer = check.split("/")[1]
            if layer == letter or (layer.startswith("layer") and layer[-1] == letter):
                seen += 1
                assert err <= TOL, (ckpt, check, err)
    assert seen >= 2 * len(CHECKPOINTS) - (letter == "-")  # every checkpoint has each kind (tiny: one '-')


def _cfg(**kw) -> ModelConfig:
    base = dict(
        hidden_size=64,
        hybrid_override_pattern="M*E-",
        num_attention_heads=8,
        num_key_value_heads=2,
        mamba_num_heads=16,
        n_groups=2,
        n_routed_experts=8,
        moe_intermediate_size=48,
        moe_shared_expert_intermediate_size=32,
        intermediate_size=64,
        vocab_size=1000,
    )
    return ModelConfig.from_hf_dict({**base, **kw})


def test_check_shardable_names_numbers_and_working_sizes():
    c = _cfg()
    check_shardable(c, 4, 1)
    check_shardable(c, 4, 4)
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(8\) is not divisible by tp \(3\).*"
        r"tp in \[1, 2, 4, 8\] with ep=1.*ep=tp in \[2, 4, 8\]",
    ):
        check_shardable(c, 3, 1)
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) is not divisible by ep \(16\)"):
        check_shardable(
            _cfg(num_attention_heads=16, mamba_num_heads=32, n_groups=16, moe_shared_expert_intermediate_size=64),
            16,
            16,
        )
    with pytest.raises(ValueError, match=r"n_groups \(3\) and tp \(2\): neither divides"):
        check_shardable(_cfg(n_groups=3, mamba_num_heads=12), 2, 1)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\) and tp \(4\)"):
        check_shardable(_cfg(num_attention_heads=12, num_key_value_heads=6), 4, 1)
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(48\) is not divisible by tp \(32\)"):
        check_shardable(_cfg(num_attention_heads=32, mamba_num_heads=32), 32, 1)
    with pytest.raises(ValueError, match="ep must be 1 or equal to tp"):
        check_shardable(c, 4, 2)
    with pytest.raises(ValueError, match="ep must be 1 or equal to tp"):
        ParallelContext(tp=4, ep=2)
    assert (8, 8) in working_sizes(c) and (16, 1) not in working_sizes(c)
    with pytest.raises(ValueError, match="intermediate_size \\(64\\) is not divisible by tp \\(3\\)"):
        NemotronHForCausalLM(_cfg(), get_kernels("torch"), ParallelContext(tp=3))


def test_rank_shapes_split_and_replicate():
    c = _cfg()
    s = [rank_shapes(c, ParallelContext(tp=4, ep=4, rank=r)) for r in range(4)]
    assert [x.kv_head_start for x in s] == [0, 0, 1, 1] and {x.kv_heads for x in s} == {1}  # 2 KV heads, tp 4
    assert [x.mamba_group_start for x in s] == [0, 0, 1, 1] and {x.group_ranks for x in s} == {2}
    assert [x.expert_start for x in s] == [0, 2, 4, 6] and {x.moe_intermediate for x in s} == {48}
    assert s[1].conv_dim == 4 * 64 + 2 * 1 * 128 and s[1].mamba_heads == 4 and s[1].vocab == 250
    e1 = rank_shapes(c, ParallelContext(tp=2, ep=1, rank=1))
    assert (e1.experts, e1.moe_intermediate, e1.moe_intermediate_start, e1.mamba_groups) == (8, 24, 24, 1)


def test_each_rank_reads_and_holds_only_its_slices(tp_paths, monkeypatch):
    """tp 4, ep 4 on one process (no collectives are needed to load): split parameters add up over the ranks to the
    whole tensor (padding rows aside), replicated ones are whole on every rank, and each rank reads from the
    safetensors file no more than it holds."""
    path = tp_paths["bias_latent_g4"]
    cfg = ModelConfig.from_model_path(path)
    whole = NemotronHForCausalLM(cfg, get_kernels("torch"))
    load_weights(whole, path, cfg.tie_word_embeddings)
    full = {n: p.numel() for n, p in whole.named_parameters()}
    sums = dict.fromkeys(full, 0)
    for r in range(4):
        par = ParallelContext(tp=4, ep=4, rank=r)
        m = NemotronHForCausalLM(cfg, get_kernels("torch"), par)
        stats = load_weights(m, path, cfg.tie_word_embeddings, par)
        held = sum(p.numel() for p in m.parameters())
        assert stats.elements_read <= held < 0.5 * sum(full.values())
        for n, p in m.named_parameters():
            sums[n] += p.numel()
    replicated = [n for n in full if sums[n] == 4 * full[n]]
    split = [n for n in full if sums[n] == full[n]]
    qkv = [n for n in full if n.endswith("qkv_proj.weight")]  # 2 KV heads on 4 ranks: each held twice
    assert all(sums[n] == (cfg.num_attention_heads + 2 * 4) * cfg.head_dim * cfg.hidden_size for n in qkv)
    assert set(replicated) | set(split) | set(qkv) | {"backbone.embeddings.weight", "lm_head.weight"} == set(full)
    assert all(
        n.endswith(
            (
                "norm.weight",
                "norm_f.weight",
                "gate.weight",
                "e_score_correction_bias",
                "latent_proj.weight",
                "fc1_latent_proj.bias",
                "fc2_latent_proj.bias",
                "out_proj.bias",
                "down_proj.bias",
            )
        )
        for n in replicated
    ), replicated  # biases: zeros off rank 0
    assert any("experts.up_proj" in n for n in split) and any("in_proj.weight" in n for n in split)
    assert sums["lm_head.weight"] == 4 * 63 * cfg.hidden_size  # 250 rows padded to 4 x 63


def test_load_weights_refuses_another_rank_layout(tp_paths):
    path = tp_paths["tiny"]
    cfg = ModelConfig.from_model_path(path)
    m = NemotronHForCausalLM(cfg, get_kernels("torch"), ParallelContext(tp=2, rank=1))
    with pytest.raises(ValueError, match="built for tp=2, ep=1, rank=1"):
        load_weights(m, path, cfg.tie_word_embeddings, ParallelContext(tp=2, rank=0))


def test_bias_variant_matches_transformers(tp_paths):
    """The tp-1 oracle of the bias checkpoint agrees with transformers' NemotronH."""
    transformers = pytest.importorskip("transformers")
    path = tp_paths["bias_latent_g4"]
    hf = transformers.NemotronHForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_ids(21, seed=3, vocab=250)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = full_prefill_logits(make_engine(path), ids)
    assert ((ours - ref).abs().max() / ref.abs().max()).item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_one_gpu_triton(tp_paths, tmp_path):
    """Two ranks on cuda:0 over gloo with the triton kernels, ep 1 and 2, the three checkpoints: logits and pools
    agree with the triton tp-1 model within 1e-3 (fp32; other GEMM shapes and reduction orders) and greedy tokens are
    identical wherever tp 1's top two logits are more than 0.05 apart."""
    tp_ranks.spawn(tp_ranks.report, 2, tp_paths, (2,), str(tmp_path), "triton", "cuda:0")
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            rep = json.load(f)["2"]
        for ckpt, checks in rep.items():
            assert all(checks[f"ep{e}/argmax_clear"] == 0 and checks[f"ep{e}/collectives"] == 0 for e in (1, 2)), (
                ckpt,
                checks,
            )
            assert max(v for k, v in checks.items() if "argmax" not in k) <= 1e-3, (ckpt, checks)


def test_sharded_checkpoint_loads_the_same_slices(tp_paths, tmp_path):
    """A checkpoint transformers writes in many shards (model.safetensors.index.json) gives every rank the same
    parameters, read in the same amounts, as the single-file one."""
    transformers = pytest.importorskip("transformers")
    single = tp_paths["latent_g1_c8"]
    sharded = str(tmp_path / "sharded")
    transformers.NemotronHForCausalLM.from_pretrained(single, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="200KB"
    )
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) >= 3
    cfg = ModelConfig.from_model_path(single)
    for r in range(2):
        par = ParallelContext(tp=2, ep=2, rank=r)
        models, stats = [], []
        for path in (single, sharded):
            models.append(NemotronHForCausalLM(cfg, get_kernels("torch"), par))
            stats.append(load_weights(models[-1], path, cfg.tie_word_embeddings, par))
        assert stats[0] == stats[1]
        b = dict(models[1].named_parameters())
        assert all(torch.equal(p, b[n]) for n, p in models[0].named_parameters())


def test_stacked_expert_checkpoint_loads_the_same_slices(tp_paths, tmp_path):
    """Experts stored stacked (`experts.up_proj` [E, I, d]) load into every rank's layout exactly as the per-expert
    `experts.{j}.up_proj.weight` tensors do (ep 1: intermediate slices; ep = tp: whole experts)."""
    src = tp_paths["tiny"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    stacked = {n: t for n, t in tensors.items() if ".experts." not in n}
    layers = sorted({n.split(".experts.")[0] for n in tensors if ".experts." in n})
    for base in layers:
        for proj in ("up_proj", "down_proj"):
            n = sum(1 for k in tensors if k.startswith(base + ".experts.") and k.endswith(proj + ".weight"))
            stacked[f"{base}.experts.{proj}"] = torch.stack(
                [tensors[f"{base}.experts.{j}.{proj}.weight"] for j in range(n)]
            )
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(stacked, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_model_path(src)
    for ep in (1, 2):
        par = ParallelContext(tp=2, ep=ep, rank=1)
        a, b = (NemotronHForCausalLM(cfg, get_kernels("torch"), par) for _ in range(2))
        load_weights(a, src, cfg.tie_word_embeddings, par)
        load_weights(b, str(dst), cfg.tie_word_embeddings, par)
        pb = dict(b.named_parameters())
        assert all(torch.equal(p, pb[n]) for n, p in a.named_parameters())


@pytest.mark.parametrize("name", ["nano_30b_a3b", "super_120b_a12b"])
def test_released_models_shard_over_2_4_8_gpus(name):
    """The released configs split at tp 2, 4 and 8 with ep = 1 or ep = tp; Super at tp 4 / ep 4: each rank holds 8
    query heads, 1 KV head, 32 of 128 Mamba heads in 2 of 8 groups, 128 of 512 experts."""
    with open(os.path.join(os.path.dirname(__file__), "fixtures", f"{name}_config.json")) as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    assert {(2, 1), (2, 2), (4, 1), (4, 4), (8, 1), (8, 8)} <= set(working_sizes(cfg))
    if name.startswith("super"):
        s = rank_shapes(cfg, ParallelContext(tp=4, ep=4, rank=3))
        assert (s.attention_heads, s.kv_heads, s.mamba_heads, s.mamba_groups, s.experts, s.expert_start) == (
            8,
            1,
            32,
            2,
            128,
            384,
        )
        assert s.conv_dim == 32 * 64 + 2 * 2 * 128 and s.group_ranks == 1 and s.vocab * 4 == cfg.vocab_size
