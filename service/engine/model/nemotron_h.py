"""NemotronH forward over one flat packed batch (prefill chunks and decode tokens mixed).

Every layer is `h = h + mixer(RMSNorm(h))`; logits = `lm_head(RMSNorm_f(h))` at the requested rows. Each residual
add runs fused with the norm that follows it (`Kernels.add_rms_norm`).
Module names equal the HF checkpoint names under `backbone.` so weights load by name, except attention's fused
`qkv_proj`, which the loader fills from the checkpoint's `q_proj`/`k_proj`/`v_proj` as its segments
(`Attention.checkpoint_parts`).

Under tensor parallelism (`ParallelContext`, docs/design.md: Tensor and expert parallelism) every rank builds the
model from its `rank_shapes` view and runs the same forward on the same tokens: each mixer returns its output summed
over the ranks (one all-reduce per layer), so the residual stream h is replicated; the embedding and lm_head are
vocabulary-parallel and the logits are all-gathered, so every rank returns the full-vocabulary logits."""

from __future__ import annotations

import torch
from torch import nn

from service.engine.config import ATTENTION, MAMBA, MOE, ModelConfig
from service.engine.config import MLP as MLP_T
from service.engine.distributed.parallel import ParallelContext, RankShapes, rank_shapes
from service.engine.kernels import Kernels
from service.engine.layers.attention import Attention
from service.engine.layers.linear import Segment
from service.engine.layers.mamba2 import Mamba2Mixer
from service.engine.layers.meta import AttentionMeta, MambaMeta
from service.engine.layers.moe import MLP, MoE
from service.engine.layers.norm import rms_norm_module
from service.engine.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, shapes: RankShapes, parallel: ParallelContext):
        super().__init__()
        self.layer_type = layer_type
        self.norm = rms_norm_module(cfg.hidden_size)
        if layer_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg, shapes, parallel)
        elif layer_type == ATTENTION:
            self.mixer = Attention(cfg, shapes, parallel)
        elif layer_type == MOE:
            self.mixer = MoE(cfg, shapes, parallel)
        elif layer_type == MLP_T:
            inter = Segment(cfg.intermediate_size, parallel.rank * shapes.intermediate, shapes.intermediate)
            self.mixer = MLP(cfg.hidden_size, inter, cfg.mlp_bias, parallel, reduce=True)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, shapes: RankShapes, parallel: ParallelContext):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shapes, parallel)
        self.layers = nn.ModuleList(Block(cfg, t, shapes, parallel) for t in cfg.layer_types)
        self.norm_f = rms_norm_module(cfg.hidden_size)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, parallel: ParallelContext = ParallelContext()):
        """Raises ValueError when cfg cannot be split over parallel.tp / parallel.ep (`check_shardable`)."""
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.parallel = parallel
        self.shapes = rank_shapes(cfg, parallel)
        self.backbone = Backbone(cfg, self.shapes, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.shapes, parallel)
        # layer index -> index into the KV pool (attention layers) or mamba pool (mamba layers)
        self.attn_pool_index = {lid: j for j, lid in enumerate(cfg.attention_layer_ids)}
        self.mamba_pool_index = {lid: j for j, lid in enumerate(cfg.mamba_layer_ids)}
        # first layer of the trailing run of MoE / MLP layers (len(layers) if the last layer mixes tokens): they act
        # on each row alone, so only the rows whose logits are read need them; an attention layer just before
        # them needs every row's K/V (the cache) but its output only at those rows
        self.row_wise_tail = len(cfg.layer_types)
        while self.row_wise_tail and cfg.layer_types[self.row_wise_tail - 1] in (MOE, MLP_T):
            self.row_wise_tail -= 1
        t = self.row_wise_tail
        self.rows_from = t - 1 if t and cfg.layer_types[t - 1] == ATTENTION else t  # first layer that may skip rows
        self.skip_rows = True  # False: every layer runs on every token (activation calibration records them all)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """Lays the loaded weights out for `self.kernels` (the one place a bundle's layouts are applied; same
        shapes and values, so every bundle's ops still take them): every non-FP8 linear weight (but one tied to the
        embedding) through `Kernels.linear_weight_layout`, the non-FP8 routed experts through
        `Kernels.moe_weight_layout`. Called after loading and after the bundle changes."""
        k, fp8 = self.kernels, torch.float8_e4m3fn
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.weight.dtype != fp8 and mod.weight is not self._embedding_weight():
                mod.weight.data = k.linear_weight_layout(mod.weight.data)
        for block in self.backbone.layers:
            if block.layer_type == MOE and block.mixer.experts.up_proj.dtype != fp8:
                e = block.mixer.experts
                e.up_proj.data, e.down_proj.data = k.moe_weight_layout(e.up_proj.data, e.down_proj.data)

    def _embedding_weight(self) -> torch.Tensor:
        return self.backbone.embeddings.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attn: AttentionMeta,
        mamba: MambaMeta,
        logits_indices: torch.Tensor,
        kv_cache: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids [T]; kv_cache [L_attn, 2, num_slots, Hkv, Dh]; conv_pool [L_mamba, S, conv_dim, K-1];
        ssm_pool [L_mamba, S, H, P, N] fp32 (Hkv, conv_dim, H: this rank's, `self.shapes`).
        Returns logits [len(logits_indices), vocab] fp32 (the full vocabulary on every rank).
        = embed -> run_layers over all layers -> logits (the CUDA-graph runner calls the pieces in segments). When
        the logits rows are fewer than T (a prefill: one row per request instead of every prompt token), the
        trailing MoE / MLP layers run on those rows alone, and an attention layer just before them writes every
        row's K/V but attends from those rows alone (`rows_from`)."""
        x, h = self.embed(input_ids)
        n, first = len(self.backbone.layers), self.rows_from
        x, h = self.run_layers(x, h, 0, first, attn, mamba, kv_cache, conv_pool, ssm_pool)
        if first == n or len(logits_indices) == x.shape[0] or not self.skip_rows:
            x, h = self.run_layers(x, h, first, n, attn, mamba, kv_cache, conv_pool, ssm_pool)
            return self.logits(x, logits_indices)
        if first < self.row_wise_tail:  # the attention layer: K/V of every row, its output at the logits rows
            block, j = self.backbone.layers[first], self.attn_pool_index[first]
            out = block.mixer(x, attn, kv_cache[j, 0], kv_cache[j, 1], self.kernels, rows=logits_indices)
            next_norm = self.backbone.layers[first + 1].norm if first + 1 < n else self.backbone.norm_f
            x, h = self.kernels.add_rms_norm(out, h[logits_indices], next_norm.weight, self.cfg.layer_norm_epsilon)
        else:
            x, h = x[logits_indices], h[logits_indices]
        x, h = self.run_layers(x, h, self.row_wise_tail, n, attn, mamba, kv_cache, conv_pool, ssm_pool)
        return self.lm_head.logits(x, self.kernels)

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] -> (x = layer 0's RMSNorm of h, h = the embeddings), both [T, hidden]."""
        h = self.backbone.embeddings(input_ids)
        return self.kernels.rms_norm(h, self.backbone.layers[0].norm.weight, self.cfg.layer_norm_epsilon), h

    def run_layers(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        start: int,
        end: int,
        attn: AttentionMeta,
        mamba: MambaMeta,
        kv_cache: torch.Tensor,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers [start, end): x = RMSNorm(h) for layer `start` -> (x for layer `end` (norm_f after the last
        layer), h after layer end-1). Each residual add runs fused with the norm that follows it; before a Mamba
        layer other than layer `start`, both run inside the layer, fused with its in_proj (`forward_add_norm`)."""
        k, eps, layers = self.kernels, self.cfg.layer_norm_epsilon, self.backbone.layers
        fused = False  # layer lid's input is (out, h): its residual add + norm are left to its in_proj
        out = x  # the previous layer's mixer output (read only when fused)
        for lid in range(start, end):
            block = layers[lid]
            if block.layer_type == MAMBA:
                j = self.mamba_pool_index[lid]
                if fused:
                    out, h = block.mixer.forward_add_norm(
                        out, h, block.norm.weight, eps, mamba, conv_pool[j], ssm_pool[j], k
                    )
                else:
                    out = block.mixer(x, mamba, conv_pool[j], ssm_pool[j], k)
            elif block.layer_type == ATTENTION:
                j = self.attn_pool_index[lid]
                out = block.mixer(x, attn, kv_cache[j, 0], kv_cache[j, 1], k)
            else:
                out = block.mixer(x, k)
            fused = lid + 1 < end and layers[lid + 1].layer_type == MAMBA
            if not fused:
                next_norm = layers[lid + 1].norm if lid + 1 < len(layers) else self.backbone.norm_f
                x, h = k.add_rms_norm(out, h, next_norm.weight, eps)
        return x, h

    def logits(self, x: torch.Tensor, logits_indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] after norm_f (row-wise, so norming every row equals norming the picked ones)
        -> logits [len(logits_indices), vocab] fp32 (all-gathered over the ranks), written into out if given."""
        return self.lm_head.logits(x[logits_indices], self.kernels, out)
