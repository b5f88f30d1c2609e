"""Quantized checkpoints in NVIDIA ModelOpt's FP8 format: the scheme, which modules it covers, their parameters.

Supported: unquantized checkpoints, and ModelOpt `quant_algo: FP8` (per-tensor): every quantized linear stores
`weight` (float8_e4m3fn), an fp32 per-tensor `weight_scale` (W ~= weight * weight_scale) and a static fp32
per-tensor `input_scale` (activations are quantized as x / input_scale); MoE experts store them per expert
(`experts.{j}.up_proj.weight_scale`, ...); with `kv_cache_quant_algo: FP8` attention stores `k_proj.k_scale` and
`v_proj.v_scale`. Modules matching `exclude_modules` (fnmatch patterns over checkpoint module names) stay in the
model dtype; the embeddings, conv1d, norms and the fp32 MoE router are never quantized.

The scheme comes from `hf_quant_config.json` (`{"producer": ..., "quantization": {...}}`) or, without it, from
config.json's `quantization_config`. Anything else (NVFP4, per-block or per-channel FP8, other quant methods) is a
ValueError naming what is supported.

In our model a quantized linear is the same module with `weight` in float8_e4m3fn and two more parameters,
`weight_scale` and `input_scale` (fp32 scalars), so tensor-parallel shards of it share the scalars. Weights keep their loaders (each rank reads its slice); scales load whole. The fused
`qkv_proj` loads its three parts' scales into [3] vectors and `finalize_fp8` requantizes the parts to their largest
scale; stacked experts hold `up_proj_weight_scale` [E] and `up_proj_input_scale` (a scalar after `finalize_fp8`:
the largest over the experts), likewise for down_proj.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from service.engine.layers.linear import Source, copy_into, get_loader, set_loader

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SUPPORTED = (
    "unquantized checkpoints, or NVIDIA ModelOpt FP8 (quant_algo 'FP8': per-tensor float8_e4m3fn weights "
    "with fp32 weight_scale and static input_scale; kv_cache_quant_algo 'FP8' or none)"
)
SCALE_SUFFIXES = ("weight_scale", "input_scale")
EXPERT_SCALES = ("up_proj_weight_scale", "up_proj_input_scale", "down_proj_weight_scale", "down_proj_input_scale")


@dataclass(frozen=True)
class QuantConfig:
    quant_algo: str | None  # None: unquantized; "FP8": ModelOpt per-tensor FP8 weights + input scales
    kv_cache_quant_algo: str | None  # None, or "FP8": the checkpoint carries k_scale / v_scale for an FP8 KV cache
    exclude_modules: tuple[str, ...]  # fnmatch patterns of checkpoint module names kept in the model dtype

    @property
    def fp8(self) -> bool:
        return self.quant_algo == "FP8"

    def excluded(self, module_name: str) -> bool:
        """Whether a module (checkpoint name, `backbone.` or `model.` prefix) or one of its parents is excluded."""
        parts = _canonical(module_name).split(".")
        names = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        names |= {"model." + n[len("backbone.") :] for n in names if n.startswith("backbone.")}
        return any(fnmatch.fnmatchcase(n, p) for n in names for p in self.exclude_modules)

    def to_hf_quant_config(self) -> dict[str, Any]:
        """The hf_quant_config.json contents of this scheme (ModelOpt layout)."""
        return {
            "producer": {"name": "modelopt", "version": "hybrid-serve"},
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": self.kv_cache_quant_algo,
                "exclude_modules": list(self.exclude_modules),
            },
        }


UNQUANTIZED = QuantConfig(None, None, ())


def _canonical(name: str) -> str:
    return "backbone." + name[len("model.") :] if name.startswith("model.") else name


def parse_quant_config(raw: dict[str, Any] | None, source: str) -> QuantConfig:
    """A ModelOpt quantization dict (hf_quant_config.json's, or config.json's quantization_config) -> QuantConfig."""
    if not raw:
        return UNQUANTIZED
    inner = raw["quantization"] if isinstance(raw.get("quantization"), dict) else raw
    method = str(raw.get("quant_method", "modelopt")).lower()
    if method != "modelopt":
        raise ValueError(f"{source}: quant_method {method!r} is not supported; supported: {SUPPORTED}")
    algo = inner.get("quant_algo")
    if algo != "FP8":
        raise ValueError(f"{source}: quant_algo {algo!r} is not supported; supported: {SUPPORTED}")
    for key in ("weight_block_size", "block_size", "group_size"):
        if inner.get(key):
            raise ValueError(f"{source}: per-block FP8 ({key}={inner[key]!r}) is not supported; supported: {SUPPORTED}")
    kv = inner.get("kv_cache_quant_algo")
    scheme = inner.get("kv_cache_scheme")
    if kv is None and isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
        kv = "FP8"
    if kv not in (None, "FP8"):
        raise ValueError(f"{source}: kv_cache_quant_algo {kv!r} is not supported; supported: FP8 or none")
    exclude = inner.get("exclude_modules") or inner.get("ignore") or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise ValueError(f"{source}: exclude_modules must be a list of module-name patterns, got {exclude!r}")
    return QuantConfig("FP8", kv, tuple(exclude))


def read_quant_config(model_path: str) -> QuantConfig:
    """The model folder's scheme: hf_quant_config.json, else config.json's quantization_config, else unquantized."""
    path = os.path.join(model_path, "hf_quant_config.json")
    if os.path.exists(path):
        with open(path) as f:
            return parse_quant_config(json.load(f), path)
    path = os.path.join(model_path, "config.json")
    if not os.path.exists(path):
        return UNQUANTIZED
    with open(path) as f:
        return parse_quant_config(json.load(f).get("quantization_config"), f"{path} quantization_config")


# ---- the model's quantized modules ------------------------------------------------------------------------------
def is_fp8(module: nn.Module) -> bool:
    """A linear whose weight is float8_e4m3fn (it then has `weight_scale` and `input_scale`)."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype == FP8_DTYPE


def experts_fp8(experts: nn.Module) -> bool:
    return experts.up_proj.dtype == FP8_DTYPE


def _scale_loader(dst: torch.Tensor, src: Source, part: int | None) -> None:
    """A per-tensor scale (stored as [] or [1]; the same on every rank) into a scalar, or into element `part` of a
    fused linear's [parts] vector."""
    if math.prod(src.shape) != 1:
        raise ValueError(f"tensor {src.name!r} has shape {src.shape}, a per-tensor scale has one element")
    copy_into(dst.view(-1)[part : part + 1] if part is not None else dst.view(1), src.read_all().reshape(1), src)


def _expert_scale_loader(expert_start: int, experts: int):
    """Per-expert scales [E_local] of the held experts: part j is expert j's scale (skipped when another rank holds
    it), part None the stacked [E] tensor."""

    def load(dst: torch.Tensor, src: Source, part: int | None) -> None:
        if part is None:
            copy_into(dst, src.read_all().reshape(-1)[expert_start : expert_start + experts], src)
        elif expert_start <= part < expert_start + experts:
            _scale_loader(dst[part - expert_start], src, None)

    return load


def _param(shape: tuple[int, ...], loader, dtype: torch.dtype = torch.float32, device=None) -> nn.Parameter:
    p = nn.Parameter(torch.ones(shape, dtype=dtype, device=device), requires_grad=False)
    set_loader(p, loader)
    return p


def _fp8_like(p: torch.Tensor) -> nn.Parameter:
    """An e4m3 parameter of p's shape and device, with p's weight loader (its rank slicing)."""
    new = nn.Parameter(torch.empty(p.shape, dtype=FP8_DTYPE, device=p.device), requires_grad=False)
    set_loader(new, get_loader(p))
    return new


def fused_parts(model: nn.Module) -> dict[str, list[str]]:
    """Our fused linear module name -> the checkpoint module names of its parts, in segment order (modules with
    `checkpoint_parts`: attention's qkv_proj <- q_proj, k_proj, v_proj)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for prefix, holder in model.named_modules():
        if hasattr(holder, "checkpoint_parts"):
            for part_name, (param, part) in holder.checkpoint_parts().items():
                out.setdefault(f"{prefix}.{param.rsplit('.', 1)[0]}", []).append(
                    (part, f"{prefix}.{part_name.rsplit('.', 1)[0]}")
                )
    return {name: [n for _, n in sorted(parts)] for name, parts in out.items()}


def apply_quantization(model: nn.Module, quant: QuantConfig) -> list[str]:
    """Turns the model's quantized linears and experts into their FP8 form (weights e4m3 + scale parameters with
    their loaders, on the weights' device, typically meta before loading) and gives attention layers k_scale /
    v_scale when the checkpoint has KV-cache scales. Returns the names of the modules made FP8. Call before
    `to_empty` / loading."""
    done: list[str] = []
    fused = fused_parts(model)
    shapes = getattr(model, "shapes", None)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if quant.kv_cache_quant_algo == "FP8" and hasattr(module, "checkpoint_parts"):  # attention: KV scales
            module.k_scale, module.v_scale = _param((), _scale_loader), _param((), _scale_loader)
        if not quant.fp8 or name == "" or leaf in ("gate", "embeddings"):
            continue
        if leaf == "experts" and isinstance(getattr(module, "up_proj", None), nn.Parameter):
            if quant.excluded(f"{name}.0.up_proj") or quant.excluded(f"{name}.0.down_proj"):
                continue
            E = module.up_proj.shape[0]
            start = shapes.expert_start if shapes is not None else 0
            module.up_proj, module.down_proj = _fp8_like(module.up_proj), _fp8_like(module.down_proj)
            for s in EXPERT_SCALES:
                module.register_parameter(s, _param((E,), _expert_scale_loader(start, E), device=module.up_proj.device))
            done.append(name)
        elif isinstance(module, nn.Linear):
            parts = fused.get(name, [name])
            excluded = {quant.excluded(p) for p in parts}
            if len(excluded) > 1:
                raise ValueError(
                    f"exclude_modules covers some of the fused projections {parts} and not the others; "
                    "quantize all of them or none"
                )
            if not excluded.pop():
                dev = module.weight.device
                module.weight = _fp8_like(module.weight)
                shape = (len(parts),) if name in fused else ()
                module.weight_scale = _param(shape, _scale_loader, device=dev)
                module.input_scale = _param(shape, _scale_loader, device=dev)
                done.append(name)
    return done


def scale_parts(model: nn.Module) -> dict[str, tuple[str, nn.Parameter, int | None]]:
    """Checkpoint names of scales that land inside one parameter of ours -> (parameter name, parameter, part): the
    fused linears' part scales (part i of the [parts] vector) and attention's `k_proj.k_scale` / `v_proj.v_scale`
    (its k_scale / v_scale, part None)."""
    out: dict[str, tuple[str, nn.Parameter, int | None]] = {}
    for fused_name, parts in fused_parts(model).items():
        module = model.get_submodule(fused_name)
        if is_fp8(module):
            for i, part in enumerate(parts):
                for suffix in SCALE_SUFFIXES:
                    out[f"{part}.{suffix}"] = (f"{fused_name}.{suffix}", getattr(module, suffix), i)
    for name, holder in model.named_modules():
        if hasattr(holder, "k_scale"):
            out[f"{name}.k_proj.k_scale"] = (f"{name}.k_scale", holder.k_scale, None)
            out[f"{name}.v_proj.v_scale"] = (f"{name}.v_scale", holder.v_scale, None)
    return out


@torch.no_grad()
def finalize_fp8(model: nn.Module) -> None:
    """After loading: each fused linear's parts are requantized to the largest part scale (one per-tensor
    weight_scale; input_scale the largest of the parts'), and each expert stack's per-expert input scales become
    their largest (one static activation scale per GEMM). Idempotent."""
    for fused_name in fused_parts(model):
        module = model.get_submodule(fused_name)
        if not is_fp8(module) or module.weight_scale.dim() == 0:
            continue
        scales = module.weight_scale.detach()
        top = scales.max()
        w = module.weight.data
        for i in range(scales.numel()):
            rows = module.local_rows(i)
            if scales[i] != top:
                w[rows] = (w[rows].float() * (scales[i] / top)).to(FP8_DTYPE)
        module.weight_scale = _param((), _scale_loader, device=w.device)
        module.weight_scale.data.copy_(top)
        top_in = module.input_scale.detach().max()
        module.input_scale = _param((), _scale_loader, device=w.device)
        module.input_scale.data.copy_(top_in)
    for _, module in model.named_modules():
        for s in ("up_proj_input_scale", "down_proj_input_scale"):
            scale = getattr(module, s, None)
            if isinstance(scale, nn.Parameter) and scale.dim():
                setattr(module, s, nn.Parameter(scale.detach().max().clone(), requires_grad=False))
