"""Tiny random NemotronH checkpoints written by transformers' own `save_pretrained` (the oracle)."""

from __future__ import annotations

import os

import torch

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    conv_kernel=4,
    intermediate_size=96,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=1,
    topk_group=1,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=1024,
    eos_token_id=2,
    bos_token_id=1,
    pad_token_id=0,
    time_step_limit=(0.0, 1e9),
    use_conv_bias=True,
    routed_scaling_factor=1.5,
)
# name -> overrides; together they cover M, *, E (with/without latent), -, n_groups 1 and 2, chunk 8 and 16
VARIANTS = {
    "mixed_g2_c16": dict(hybrid_override_pattern="M*ME-M", n_groups=2, chunk_size=16),
    "latent_g1_c8": dict(
        hybrid_override_pattern="ME*M-E", n_groups=1, chunk_size=8, moe_latent_size=24, norm_topk_prob=False
    ),
    "attn_first_c8": dict(
        hybrid_override_pattern="*MM-EM", n_groups=2, chunk_size=8, use_conv_bias=False, n_group=2, topk_group=1
    ),
    # ends in an attention layer and a MoE: the last attention attends from the logits rows alone
    "attn_tail_c8": dict(hybrid_override_pattern="M-*E", n_groups=2, chunk_size=8),
    # biases everywhere (mamba in/out_proj, MLPs, latent projections), 4 groups, a vocabulary 4 does not divide
    "bias_latent_g4": dict(
        hybrid_override_pattern="M*E-ME",
        n_groups=4,
        chunk_size=8,
        moe_latent_size=24,
        use_bias=True,
        mlp_bias=True,
        vocab_size=250,
    ),
}


def write_hf_checkpoint(out_dir: str, variant: str, seed: int = 0) -> str:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    torch.manual_seed(seed)
    cfg = NemotronHConfig(**{**BASE, **VARIANTS[variant]})
    model = NemotronHForCausalLM(cfg).eval()
    with torch.no_grad():  # make every parameter matter: random norms, biases, routing bias
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # conv1d, and with use_bias / mlp_bias the linears
                p.copy_(0.1 * torch.randn_like(p))
            elif "weight" in name and p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(0.05 * torch.randn_like(mod.e_score_correction_bias))
    model.save_pretrained(out_dir)
    return out_dir
