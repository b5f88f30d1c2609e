"""Model construction: the module tree on the meta device, the checkpoint's quantization applied to it, then
materialized once on the target device in its final dtypes (no fp32 or host copy of the weights is ever made) and
filled from the checkpoint (`load_format="auto"`) or with dummy weights (`"dummy"`)."""

from __future__ import annotations

import torch

from service.engine.config import EngineConfig, ModelConfig
from service.engine.distributed.parallel import ParallelContext
from service.engine.kernels import Kernels
from service.engine.layers.linear import set_loader
from service.engine.model.dummy import init_dummy_weights
from service.engine.model.nemotron_h import NemotronHForCausalLM
from service.engine.model.quant import QuantConfig, apply_quantization, finalize_fp8, read_quant_config
from service.engine.model.weights import load_weights


def create_model(
    model_cfg: ModelConfig,
    kernels: Kernels,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig,
    parallel: ParallelContext | None = None,
) -> NemotronHForCausalLM:
    """This rank's model on `device` with uninitialized weights: dtype everywhere except the fp32 MoE routers and the
    quantized modules (FP8 weights, fp32 scales)."""
    with torch.device("meta"):
        model = NemotronHForCausalLM(model_cfg, kernels, parallel or ParallelContext())
    model.to(dtype)
    for block in model.backbone.layers:  # router stays fp32 (as in the checkpoint)
        if hasattr(block.mixer, "gate"):
            block.mixer.gate.float()
    apply_quantization(model, quant)
    loaders = {name: p.weight_loader for name, p in model.named_parameters() if hasattr(p, "weight_loader")}
    model.to_empty(device=device)  # new parameters (meta -> device): their loaders are set again
    for name, p in model.named_parameters():
        if name in loaders:
            set_loader(p, loaders[name])
    return model


def build_model(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    kernels: Kernels,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext | None = None,
) -> NemotronHForCausalLM:
    """This rank's model with its weights, read from cfg.model_path or drawn (cfg.load_format), laid out for
    `kernels` (`prepare_weights`), in eval mode."""
    quant = read_quant_config(cfg.model_path)
    model = create_model(model_cfg, kernels, dtype, device, quant, parallel)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
        if model_cfg.tie_word_embeddings:
            model.lm_head.weight = model.backbone.embeddings.weight
    else:
        load_weights(model, cfg.model_path, model_cfg.tie_word_embeddings, model.parallel)
    finalize_fp8(model)
    model.prepare_weights()
    return model.eval()
