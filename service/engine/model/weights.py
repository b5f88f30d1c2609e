"""Load HF safetensors checkpoints (single file or sharded with an index) by the checkpoint's own names.

Accepted name forms: `backbone.*` (NVIDIA's) or `model.*` (transformers' in-memory), per-expert
`mixer.experts.{j}.up_proj.weight` or stacked `mixer.experts.up_proj`. A module with `checkpoint_rows()` (attention:
HF `q_proj`/`k_proj`/`v_proj` -> row ranges of the fused `qkv_proj`) takes those checkpoint tensors into row ranges of
one parameter. `mtp.*` tensors (MTP heads) are skipped for now. Missing or unexpected tensors raise one `ValueError`
that lists them."""
from __future__ import annotations

import json
import os
import re

import torch
from safetensors import safe_open
from torch import nn

_EXPERT = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    single = os.path.join(model_path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {model_path!r}")


def _canonical(name: str) -> str:
    if name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name


def load_weights(model: nn.Module, model_path: str, tie_word_embeddings: bool = False) -> None:
    """Copies every checkpoint tensor into `model` (casting to the parameter's dtype/device)."""
    fused = _fused_rows(model)
    fused_targets = {param_name for param_name, _, _ in fused.values()}   # loaded only through their parts
    params = {name: p for name, p in model.named_parameters() if name not in fused_targets}
    expected = _expected_names(params) | set(fused)
    if tie_word_embeddings:
        expected.discard("lm_head.weight")
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for raw in f.keys():
                name = _canonical(raw)
                if name.startswith("mtp."):
                    continue
                target, index = _resolve(name, params, fused)
                if target is None:
                    unexpected.append(raw)
                    continue
                _copy(target, index, f.get_tensor(raw), raw)
                loaded.update(_loaded_names(name, index, target))
    missing = sorted(expected - loaded)
    if missing or unexpected:
        raise ValueError(f"checkpoint {model_path!r} does not match the model: "
                         f"missing tensors {missing[:50]}{' ...' if len(missing) > 50 else ''}; "
                         f"unexpected tensors {sorted(unexpected)[:50]}")
    if tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight


def _fused_rows(model: nn.Module) -> dict[str, tuple[str, nn.Parameter, slice]]:
    """Checkpoint name -> (parameter name, parameter, its rows) for every module with `checkpoint_rows()`."""
    fused: dict[str, tuple[str, nn.Parameter, slice]] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "checkpoint_rows"):
            for part, (param, start, end) in module.checkpoint_rows().items():
                fused[f"{prefix}.{part}" if prefix else part] = (f"{prefix}.{param}" if prefix else param,
                                                                 module.get_parameter(param), slice(start, end))
    return fused


def _expected_names(params: dict[str, nn.Parameter]) -> set[str]:
    """The checkpoint names `params` need (stacked experts: the per-expert names)."""
    expected: set[str] = set()
    for name, p in params.items():
        expected.update(_per_expert_names(name, p.shape[0]) if _is_stacked_experts(name) else [name])
    return expected


def _resolve(name: str, params: dict[str, nn.Parameter], fused: dict[str, tuple[str, nn.Parameter, slice]]
             ) -> tuple[nn.Parameter | None, int | slice | None]:
    """The parameter a checkpoint tensor goes to, and where: an expert index, a row range, or None (all of it)."""
    if name in fused:
        _, param, rows = fused[name]
        return param, rows
    m = _EXPERT.match(name)
    if m:
        return params.get(f"{m.group(1)}.{m.group(3)}"), int(m.group(2))
    if name.endswith(".gate.e_score_correction_bias") or name in params:
        return params.get(name), None
    return None, None


def _is_stacked_experts(name: str) -> bool:
    return name.endswith("experts.up_proj") or name.endswith("experts.down_proj")


def _per_expert_names(stacked_name: str, num_experts: int) -> list[str]:
    """`...experts.up_proj` -> the checkpoint's `...experts.{j}.up_proj.weight` names."""
    base, proj = stacked_name.rsplit(".", 1)
    return [f"{base}.{j}.{proj}.weight" for j in range(num_experts)]


def _loaded_names(name: str, index: int | slice | None, target: nn.Parameter) -> list[str]:
    if index is None and _is_stacked_experts(name):   # stacked form in the checkpoint
        return _per_expert_names(name, target.shape[0])
    return [name]


def _copy(target: nn.Parameter, index: int | slice | None, tensor: torch.Tensor, raw: str) -> None:
    dst = target.data if index is None else target.data[index]
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"tensor {raw!r} has shape {tuple(tensor.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(tensor.to(dtype=dst.dtype))
