"""NemotronH forward over one flat packed batch (prefill chunks and decode tokens mixed).

Every layer is `h = h + mixer(RMSNorm(h))`; logits = `lm_head(RMSNorm_f(h))` at the requested rows. Each residual
add runs fused with the norm that follows it (`Kernels.add_rms_norm`).
Module names equal the HF checkpoint names under `backbone.` so weights load by name."""
from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ATTENTION, MAMBA, MLP as MLP_T, MOE, ModelConfig
from service.engine.kernels import Kernels
from service.engine.layers.attention import Attention
from service.engine.layers.mamba2 import Mamba2Mixer
from service.engine.layers.meta import AttentionMeta, MambaMeta
from service.engine.layers.moe import MLP, MoE
from service.engine.layers.norm import rms_norm_module


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.norm = rms_norm_module(cfg.hidden_size)
        if layer_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg)
        elif layer_type == ATTENTION:
            self.mixer = Attention(cfg)
        elif layer_type == MOE:
            self.mixer = MoE(cfg)
        elif layer_type == MLP_T:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, t) for t in cfg.layer_types)
        self.norm_f = rms_norm_module(cfg.hidden_size)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.backbone = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # layer index -> index into the KV pool (attention layers) or mamba pool (mamba layers)
        self.attn_pool_index = {lid: j for j, lid in enumerate(cfg.attention_layer_ids)}
        self.mamba_pool_index = {lid: j for j, lid in enumerate(cfg.mamba_layer_ids)}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn: AttentionMeta, mamba: MambaMeta, logits_indices: torch.Tensor,
                kv_cache: torch.Tensor, conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> torch.Tensor:
        """input_ids [T]; kv_cache [L_attn, 2, num_slots, Hkv, Dh]; conv_pool [L_mamba, S, conv_dim, K-1];
        ssm_pool [L_mamba, S, H, P, N] fp32. Returns logits [len(logits_indices), vocab] fp32."""
        k, eps, layers = self.kernels, self.cfg.layer_norm_epsilon, self.backbone.layers
        h = self.backbone.embeddings(input_ids)
        x = k.rms_norm(h, layers[0].norm.weight, eps)
        for lid, block in enumerate(layers):
            if block.layer_type == MAMBA:
                j = self.mamba_pool_index[lid]
                out = block.mixer(x, mamba, conv_pool[j], ssm_pool[j], k)
            elif block.layer_type == ATTENTION:
                j = self.attn_pool_index[lid]
                out = block.mixer(x, attn, kv_cache[j, 0], kv_cache[j, 1], k)
            else:
                out = block.mixer(x, k)
            # h = h + out, fused with the next norm (the next layer's, or norm_f after the last layer)
            next_norm = layers[lid + 1].norm if lid + 1 < len(layers) else self.backbone.norm_f
            x, h = k.add_rms_norm(out, h, next_norm.weight, eps)
        # norm_f ran on every row (row-wise, so equal to norming the picked rows only)
        return self.lm_head(x[logits_indices]).float()
