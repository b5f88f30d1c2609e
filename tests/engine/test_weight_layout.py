"""The load-time weight layout of a kernel bundle (`NemotronHForCausalLM.prepare_weights`): the torch bundle stores
the linears' weights transposed and the routed experts as the rows its grouped GEMMs read, with the values
transformers loads from the same checkpoint; another bundle gets them back row-major."""

from __future__ import annotations

import torch
import transformers

from service.engine import EngineConfig
from service.engine.config import MOE, ModelConfig
from service.engine.kernels import get_kernels, torch_reference_kernels
from service.engine.model import loader


def _experts(model) -> list:
    return [b.mixer.experts for b in model.backbone.layers if b.layer_type == MOE]


def test_torch_bundle_lays_out_expert_weights_at_load(mixed_ckpt):
    cfg = EngineConfig(model_path=mixed_ckpt, device="cpu", dtype="float32", kernel_backend="torch")
    model = loader.build_model(
        cfg, ModelConfig.from_model_path(mixed_ckpt), get_kernels("torch"), torch.float32, torch.device("cpu")
    )
    hf = transformers.NemotronHForCausalLM.from_pretrained(mixed_ckpt, dtype=torch.float32)
    hf_state = dict(hf.named_parameters())
    moe_ids = [i for i, b in enumerate(model.backbone.layers) if b.layer_type == MOE]
    assert moe_ids
    lm_head = model.lm_head.weight
    assert lm_head.t().is_contiguous() and not lm_head.is_contiguous()
    torch.testing.assert_close(lm_head.detach(), hf.lm_head.weight.detach(), rtol=0, atol=0)
    for i, e in zip(moe_ids, _experts(model)):
        assert e.down_proj.transpose(1, 2).is_contiguous() and not e.down_proj.is_contiguous()
        assert e.up_proj.permute(2, 0, 1).is_contiguous() and not e.up_proj.is_contiguous()
        for name in ("up_proj", "down_proj"):
            want = hf_state[f"model.layers.{i}.mixer.experts.{name}"].detach()
            torch.testing.assert_close(getattr(e, name).detach(), want, rtol=0, atol=0)
    model.kernels = torch_reference_kernels()
    model.prepare_weights()
    assert model.lm_head.weight.is_contiguous()
    for i, e in zip(moe_ids, _experts(model)):
        assert e.down_proj.is_contiguous() and e.up_proj.is_contiguous()
        want = hf_state[f"model.layers.{i}.mixer.experts.down_proj"].detach()
        torch.testing.assert_close(e.down_proj.detach(), want, rtol=0, atol=0)
