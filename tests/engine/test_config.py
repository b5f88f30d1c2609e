"""ModelConfig parsing of HF NemotronH config.json, checked against transformers' NemotronHConfig and
the parameter counts of transformers' NemotronHForCausalLM (the oracle).

Fixtures hold the published config.json values of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 and
nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from service.engine.config import ModelConfig

FIXTURES = Path(__file__).parent / "fixtures"
LIST_NAMES = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
LEGACY_LIST_NAMES = {"M": "mamba", "*": "attention", "E": "moe", "-": "mlp"}


def load_fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}_config.json").read_text())


def tiny(**over: Any) -> dict[str, Any]:
    """A small, valid NemotronH config.json dict (with a finite time_step_limit: transformers writes infinity as a non-JSON object)."""
    base: dict[str, Any] = {
        "model_type": "nemotron_h",
        "vocab_size": 64,
        "hidden_size": 32,
        "hybrid_override_pattern": "M*E-M",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "chunk_size": 8,
        "use_conv_bias": True,
        "use_bias": False,
        "time_step_min": 0.001,
        "time_step_limit": [0.0, 100.0],
        "intermediate_size": 20,
        "mlp_bias": False,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24,
        "moe_latent_size": None,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    base.update(over)
    return base


TINY_CASES = {
    "dense-moe+mlp, conv bias, 2 groups": tiny(),
    "latent-moe, no conv bias, 1 group": tiny(
        hybrid_override_pattern="ME*EM", moe_latent_size=12, use_conv_bias=False, n_groups=1
    ),
    # transformers keeps a separate lm_head even with tie_word_embeddings=true
    "latent-moe + mlp layers, all biases, tie flag": tiny(
        hybrid_override_pattern="M-*-E", moe_latent_size=8, use_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
}


# ---------------------------------------------------------------- published configs


@pytest.mark.parametrize("name, expected_params", [("nano_30b_a3b", 31.58e9), ("super_120b_a12b", 120.67e9)])
def test_published_parameter_count_without_mtp(name: str, expected_params: float) -> None:
    cfg = ModelConfig.from_hf_dict(load_fixture(name))
    assert cfg.num_parameters() == pytest.approx(expected_params, rel=5e-3)


def test_nano_shape_and_layer_map() -> None:
    cfg = ModelConfig.from_hf_dict(load_fixture("nano_30b_a3b"))
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (52, 2688, 131072)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_latent_size) == (128, 6, None)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size) == (64, 64, 8, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 2, 128)
    assert cfg.attention_layer_ids == (5, 12, 19, 26, 33, 42)
    assert len(cfg.mamba_layer_ids) == 23 and cfg.layer_types.count("E") == 23
    assert "-" not in cfg.layer_types
    assert cfg.num_nextn_predict_layers == 0
    assert (cfg.mamba_intermediate, cfg.conv_dim, cfg.in_proj_dim) == (4096, 6144, 10304)
    assert cfg.dt_clamp == (0.001, math.inf)


def test_super_shape_layer_map_and_mtp() -> None:
    cfg = ModelConfig.from_hf_dict(load_fixture("super_120b_a12b"))
    assert (cfg.num_layers, cfg.hidden_size) == (88, 4096)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_latent_size) == (512, 22, 1024)
    assert (cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size) == (2688, 5376)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups) == (128, 64, 8)
    assert cfg.routed_scaling_factor == 5.0
    assert cfg.attention_layer_ids == (7, 16, 25, 36, 47, 58, 69, 78)
    assert len(cfg.mamba_layer_ids) == 40 and cfg.layer_types.count("E") == 40
    assert (cfg.num_nextn_predict_layers, cfg.mtp_layer_types) == (1, ("*", "E"))
    assert cfg.num_parameters(include_mtp=True) > cfg.num_parameters()


@pytest.mark.parametrize("name", ["nano_30b_a3b", "super_120b_a12b"])
def test_published_count_equals_transformers_model_on_meta(name: str) -> None:
    """Exact: every tensor transformers' NemotronHForCausalLM would save for this config."""
    raw = load_fixture(name)
    with torch.device("meta"):
        model = NemotronHForCausalLM(NemotronHConfig(**raw))
    assert ModelConfig.from_hf_dict(raw).num_parameters() == _checkpoint_numel(model)


# ---------------------------------------------------------------- encodings and aliases


@pytest.mark.parametrize("names", [LIST_NAMES, LEGACY_LIST_NAMES], ids=["current-names", "legacy-names"])
@pytest.mark.parametrize(
    "raw",
    [load_fixture("nano_30b_a3b"), load_fixture("super_120b_a12b"), tiny(hybrid_override_pattern="M-*-E")],
    ids=["nano", "super", "tiny-mlp"],
)
def test_pattern_and_block_list_encodings_agree(raw: dict[str, Any], names: dict[str, str]) -> None:
    as_list = dict(raw)
    pattern = as_list.pop("hybrid_override_pattern")
    as_list["layers_block_type"] = [names[c] for c in pattern]
    if "mtp_hybrid_override_pattern" in as_list:
        as_list["mtp_layers_block_type"] = [names[c] for c in as_list.pop("mtp_hybrid_override_pattern")]
    assert ModelConfig.from_hf_dict(as_list) == ModelConfig.from_hf_dict(raw)


def test_legacy_mamba_aliases_match_canonical_keys_and_transformers() -> None:
    canonical = tiny(
        n_groups=2, conv_kernel=3, chunk_size=16, use_conv_bias=False, time_step_min=0.01, time_step_limit=[0.0, 50.0]
    )
    legacy = dict(canonical)
    for old, new in [
        ("mamba_n_groups", "n_groups"),
        ("mamba_d_conv", "conv_kernel"),
        ("mamba_chunk_size", "chunk_size"),
        ("mamba_conv_bias", "use_conv_bias"),
        ("mamba_dt_min", "time_step_min"),
        ("mamba_dt_limit", "time_step_limit"),
    ]:
        legacy[old] = legacy.pop(new)
    ours = ModelConfig.from_hf_dict(legacy)
    assert ours == ModelConfig.from_hf_dict(canonical)
    assert (ours.n_groups, ours.conv_kernel, ours.chunk_size, ours.use_conv_bias) == (2, 3, 16, False)
    _assert_same_as_transformers(ours, NemotronHConfig(**legacy))


def test_time_step_limit_written_by_transformers() -> None:
    """transformers serialises infinity as {"__float__": "Infinity"} (non-standard JSON)."""
    text = NemotronHConfig(**tiny(time_step_limit=[0.0, math.inf])).to_json_string()
    raw = json.loads(text)
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.time_step_limit == (0.0, math.inf)
    tagged_low = tiny(time_step_limit=[{"__float__": "-Infinity"}, 3.0])
    assert ModelConfig.from_hf_dict(tagged_low).time_step_limit == (-math.inf, 3.0)
    assert ModelConfig.from_hf_dict(tiny(time_step_limit=[0.0, math.inf])).time_step_limit == (0.0, math.inf)


# ---------------------------------------------------------------- errors name the field


@pytest.mark.parametrize(
    "over, field",
    [
        ({"mamba_num_heads": 6, "n_groups": 4}, "mamba_num_heads"),
        ({"hybrid_override_pattern": "M*XE"}, "hybrid_override_pattern"),
        ({"hybrid_override_pattern": None, "layers_block_type": ["mamba", "sliding_attention"]}, "layers_block_type"),
        ({"mamba_n_groups": 1, "n_groups": 2}, "mamba_n_groups"),
        ({"num_experts_per_tok": 5, "n_routed_experts": 4}, "num_experts_per_tok"),
        ({"mtp_hybrid_override_pattern": "*Q", "num_nextn_predict_layers": 1}, "mtp_hybrid_override_pattern"),
        ({"time_step_limit": [0.0, {"__float__": "NaN"}]}, "time_step_limit"),
        ({"time_step_limit": [0.0]}, "time_step_limit"),
        ({"hybrid_override_pattern": "M*E", "layers_block_type": ["mamba", "moe", "attention"]}, "layers_block_type"),
        ({"hybrid_override_pattern": None}, "hybrid_override_pattern"),
    ],
)
def test_inconsistent_config_raises_naming_field(over: dict[str, Any], field: str) -> None:
    raw = {k: v for k, v in tiny(**over).items() if v is not None or k == "moe_latent_size"}
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict(raw)


def test_published_config_with_broken_group_split_is_rejected() -> None:
    raw = load_fixture("nano_30b_a3b") | {"n_groups": 7}
    with pytest.raises(ValueError, match="n_groups"):
        ModelConfig.from_hf_dict(raw)


# ---------------------------------------------------------------- oracle: transformers

PARITY_CASES = {
    "nano": load_fixture("nano_30b_a3b"),
    "super": load_fixture("super_120b_a12b"),
    **TINY_CASES,
    "defaults only": {"hidden_size": 256, "hybrid_override_pattern": "M*-E"},
    "eos list, mtp list": tiny(
        eos_token_id=[2, 11], num_nextn_predict_layers=1, mtp_layers_block_type=["attention", "moe"]
    ),
}


@pytest.mark.parametrize("raw", list(PARITY_CASES.values()), ids=list(PARITY_CASES))
def test_parse_matches_transformers_config(raw: dict[str, Any]) -> None:
    _assert_same_as_transformers(ModelConfig.from_hf_dict(raw), NemotronHConfig(**raw))


@pytest.mark.parametrize("raw", list(TINY_CASES.values()), ids=list(TINY_CASES))
def test_num_parameters_equals_transformers_model(raw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = NemotronHForCausalLM(NemotronHConfig(**raw))
    cfg = ModelConfig.from_hf_dict(raw)
    expected = _checkpoint_numel(model)
    assert cfg.num_parameters() == expected
    # the count is sensitive to every option these cases vary
    assert expected != _checkpoint_numel(
        NemotronHForCausalLM(NemotronHConfig(**(raw | {"mlp_bias": not raw["mlp_bias"]})))
    )


def _checkpoint_numel(model: torch.nn.Module) -> int:
    """Elements of what save_pretrained writes: de-duplicated parameters plus persistent buffers.

    NemotronH's only buffers are the routers' e_score_correction_bias (checked here).
    """
    buffers = dict(model.named_buffers())
    assert all(name.endswith("gate.e_score_correction_bias") for name in buffers), sorted(buffers)
    return sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in buffers.values())


def _assert_same_as_transformers(ours: ModelConfig, theirs: NemotronHConfig) -> None:
    special = {
        "layer_types": (ours.pattern, theirs.hybrid_override_pattern),
        "mtp_layer_types": ("".join(ours.mtp_layer_types), theirs.mtp_hybrid_override_pattern),
        "eos_token_id": (
            ours.eos_token_id,
            tuple(theirs.eos_token_id) if isinstance(theirs.eos_token_id, list) else (theirs.eos_token_id,),
        ),
        "time_step_limit": (ours.time_step_limit, tuple(float(x) for x in theirs.time_step_limit)),
        "torch_dtype": (ours.torch_dtype, str(theirs.dtype or "bfloat16").removeprefix("torch.")),
    }
    mismatches = {}
    for f in dataclasses.fields(ModelConfig):
        mine, ref = special.get(f.name) or (getattr(ours, f.name), getattr(theirs, f.name))
        if mine != ref:
            mismatches[f.name] = (mine, ref)
    assert not mismatches, mismatches
