"""Dummy weights: random NemotronH weights drawn on the model's own device from config.json alone.

Each parameter is drawn by a generator on its device seeded from (seed, parameter name), so the weights depend only
on the seed and the config, not on the order of drawing. Big tensors are drawn in slices of the first dimension
(one expert, or a few thousand rows, at a time), so no full-size fp32 copy is ever made. FP8 linears are drawn in
fp32 and quantized with a per-tensor scale that covers +-8 standard deviations; their static input scale covers
activations up to +-DUMMY_INPUT_RANGE.

Scaling keeps activations finite through any depth: linears are normal(0, 1/sqrt(fan_in)) so every projection
of a unit-RMS input has unit RMS (each layer adds O(1) to the residual stream; the RMSNorms renormalize), the
router is fp32 normal(0, 1/sqrt(hidden)) with zero correction bias, norms are 1, the depthwise conv is
uniform(+-1/sqrt(K)) (PyTorch's Conv1d default), A_log = log(uniform(1, 16)), D = 1 and dt_bias =
softplus^-1(dt) for dt log-uniform in [1e-3, 1e-1] (as Mamba-2 initializes them), embeddings normal(0, 1).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from service.engine.model.quant import EXPERT_SCALES, FP8_DTYPE, FP8_MAX

DUMMY_INPUT_RANGE = 32.0  # |activation| an FP8 linear's static input scale covers
_WEIGHT_SIGMAS = 8.0  # |weight| / std an FP8 weight scale covers
_SLICE_ELEMENTS = 1 << 26  # elements drawn per slice (256 MiB of fp32)


def _generator(device: torch.device, seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return g


def _fill_slices(p: torch.Tensor, draw, g: torch.Generator, scale: float = 1.0) -> None:
    """p (any shape) filled slice by slice along dim 0 with draw(shape, generator) fp32 values; into an FP8 p they go
    divided by `scale`, clamped to the e4m3 range."""
    rows = max(1, _SLICE_ELEMENTS // max(1, p[0].numel())) if p.dim() else 1
    flat = p.view(1) if p.dim() == 0 else p
    for start in range(0, flat.shape[0], rows):
        dst = flat[start : start + rows]
        values = draw(tuple(dst.shape), g)
        if p.dtype == FP8_DTYPE:
            values = values.div_(scale).clamp_(-FP8_MAX, FP8_MAX)
        dst.copy_(values)


def _normal(std: float, device: torch.device):
    return lambda shape, g: torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(std)


def _uniform(lo: float, hi: float, device: torch.device):
    return lambda shape, g: torch.rand(shape, generator=g, device=device, dtype=torch.float32).mul_(hi - lo).add_(lo)


def _dt_bias(shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    dt = torch.exp(torch.rand(shape, generator=g, device=device) * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
    return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)


def _fp8_weight_scale(std: float) -> float:
    return _WEIGHT_SIGMAS * std / FP8_MAX


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fills every parameter of `model` (already on its device, any dtype, FP8 linears with their scales) in place."""
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name]
        g = _generator(p.device, seed, name)
        dev = p.device
        if leaf in ("weight_scale", "input_scale", "k_scale", "v_scale") or leaf in EXPERT_SCALES:
            continue  # set with their weights below
        if leaf in ("up_proj", "down_proj") and owner_name.endswith("experts"):  # stacked experts [E, out, in]
            std = 1.0 / math.sqrt(p.shape[-1])
            scale = _fp8_weight_scale(std)
            _fill_slices(p, _normal(std, dev), g, scale)
            if p.dtype == FP8_DTYPE:
                getattr(owner, f"{leaf}_weight_scale").data.fill_(scale)
                getattr(owner, f"{leaf}_input_scale").data.fill_(DUMMY_INPUT_RANGE / FP8_MAX)
        elif leaf == "A_log":
            p.copy_(torch.empty(p.shape, device=dev).uniform_(1.0, 16.0, generator=g).log())
        elif leaf == "dt_bias":
            p.copy_(_dt_bias(tuple(p.shape), g, dev))
        elif leaf == "D" or "norm" in owner_name.rsplit(".", 1)[-1]:
            p.fill_(1.0)
        elif leaf in ("bias", "e_score_correction_bias"):
            p.zero_()
        elif owner_name.endswith("embeddings"):
            _fill_slices(p, _normal(1.0, dev), g)
        elif owner_name.endswith("conv1d"):
            bound = 1.0 / math.sqrt(owner.kernel_size[0])
            _fill_slices(p, _uniform(-bound, bound, dev), g)
        elif p.dim() == 2:  # linears and the router
            std = 1.0 / math.sqrt(p.shape[1])
            scale = _fp8_weight_scale(std)
            _fill_slices(p, _normal(std, dev), g, scale)
            if p.dtype == FP8_DTYPE:
                owner.weight_scale.data.fill_(scale)
                owner.input_scale.data.fill_(DUMMY_INPUT_RANGE / FP8_MAX)
        else:
            raise ValueError(f"dummy weights: no rule for parameter {name!r} of shape {tuple(p.shape)}")
    for module in modules.values():
        if hasattr(module, "k_scale"):  # FP8 KV cache: unit scales
            module.k_scale.data.fill_(1.0)
            module.v_scale.data.fill_(1.0)
