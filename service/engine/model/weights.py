"""Load HF safetensors checkpoints (single file or sharded with an index) by the checkpoint's own names, each rank
reading only its slices.

Accepted name forms: `backbone.*` (NVIDIA's) or `model.*` (transformers' in-memory), per-expert
`mixer.experts.{j}.up_proj.weight` or stacked `mixer.experts.up_proj`. A module with `checkpoint_parts()` (attention:
HF `q_proj`/`k_proj`/`v_proj` -> segments of the fused `qkv_proj`) takes those checkpoint tensors as parts of one
parameter. Every tensor goes through its parameter's `weight_loader` (layers/linear.py) with a lazy `Source` over
safetensors' `get_slice`, so a rank reads only the rows/columns it holds (and skips experts other ranks hold): no
rank materialises the whole model. `mtp.*` tensors (MTP heads) are skipped for now. Missing or unexpected tensors
raise one `ValueError` that lists them."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from service.engine.distributed.parallel import ParallelContext
from service.engine.layers.linear import Source, get_loader
from service.engine.model.quant import scale_parts

_EXPERT = re.compile(
    r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.(weight|weight_scale|input_scale)$"
)
_STACKED = re.compile(r"experts\.(up_proj|down_proj)(?:_(weight_scale|input_scale))?$")


@dataclass(frozen=True)
class LoadStats:
    tensors: int  # checkpoint tensors this rank read from (all or part)
    elements_read: int  # tensor elements this rank read (its slices)


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
        return "backbone." + name[len("model.") :]
    return name


class _Counter:
    def __init__(self) -> None:
        self.tensors = self.elements = 0

    def source(self, name: str, shape: tuple[int, ...], read) -> Source:
        def counted(index: tuple[slice, ...]) -> torch.Tensor:
            t = read(index)
            self.elements += t.numel()
            return t

        return Source(name, shape, counted)


def load_weights(
    model: nn.Module, model_path: str, tie_word_embeddings: bool = False, parallel: ParallelContext | None = None
) -> LoadStats:
    """Copies this rank's slice of every checkpoint tensor into `model` (casting to the parameter's dtype/device).
    parallel: the context `model` was built with (checked; None: the model's)."""
    _check_parallel(model, parallel)
    return _load(model, _checkpoint_tensors(model_path), model_path, tie_word_embeddings)


def _checkpoint_tensors(model_path: str):
    """Per file: [(raw name, opener)] where opener() -> (shape, read(index)); the file stays open meanwhile."""
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:

            def opener(raw: str):
                sl = f.get_slice(raw)
                return tuple(sl.get_shape()), lambda index: sl[index]

            yield [(raw, lambda raw=raw: opener(raw)) for raw in f.keys()]


def _load(model: nn.Module, files, model_path: str, tie_word_embeddings: bool) -> LoadStats:
    """files: per checkpoint file, its (name, opener) pairs (`_checkpoint_tensors`); each tensor goes to its
    parameter's loader, which reads only this rank's part."""
    parts = _checkpoint_parts(model)
    part_targets = {param_name for param_name, _, _ in parts.values()}  # loaded only through their parts
    params = {name: p for name, p in model.named_parameters() if name not in part_targets}
    expected = _expected_names(params, part_targets) | set(parts)
    if tie_word_embeddings:
        expected.discard("lm_head.weight")
    seen: set[str] = set()
    unexpected: list[str] = []
    counter = _Counter()
    for tensors in files:
        for raw, opener in tensors:
            name = _canonical(raw)
            if name.startswith("mtp."):
                continue
            target, part = _resolve(name, params, parts)
            if target is None:
                unexpected.append(raw)
                continue
            before = counter.elements
            get_loader(target)(target.data, counter.source(raw, *opener()), part)
            counter.tensors += counter.elements > before
            seen.update(_names_covered(name, part, target, model))
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_path!r} does not match the model: "
            f"missing tensors {missing[:50]}{' ...' if len(missing) > 50 else ''}; "
            f"unexpected tensors {sorted(unexpected)[:50]}"
        )
    if tie_word_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    return LoadStats(counter.tensors, counter.elements)


def _check_parallel(model: nn.Module, parallel: ParallelContext | None) -> None:
    mine = getattr(model, "parallel", ParallelContext())
    if parallel is not None and (parallel.tp, parallel.ep, parallel.rank) != (mine.tp, mine.ep, mine.rank):
        raise ValueError(
            f"load_weights for tp={parallel.tp}, ep={parallel.ep}, rank={parallel.rank}, but the model "
            f"was built for tp={mine.tp}, ep={mine.ep}, rank={mine.rank}"
        )


def _checkpoint_parts(model: nn.Module) -> dict[str, tuple[str, nn.Parameter, int]]:
    """Checkpoint name -> (parameter name, parameter, its part) for every module with `checkpoint_parts()`."""
    parts: dict[str, tuple[str, nn.Parameter, int]] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "checkpoint_parts"):
            for name, (param, part) in module.checkpoint_parts().items():
                parts[f"{prefix}.{name}" if prefix else name] = (
                    f"{prefix}.{param}" if prefix else param,
                    module.get_parameter(param),
                    part,
                )
    parts.update(scale_parts(model))  # FP8: the fused linears' part scales, attention's k/v scales
    return parts


def _expected_names(params: dict[str, nn.Parameter], part_targets: set[str]) -> set[str]:
    """The checkpoint names `params` need (stacked experts: the per-expert names; parts: named by the caller)."""
    expected: set[str] = set()
    for name in params:
        if name in part_targets:
            continue
        expected.update(_per_expert_names(name, _num_experts(name, params)) if _is_stacked_experts(name) else [name])
    return expected


def _num_experts(stacked_name: str, params: dict[str, nn.Parameter]) -> int:
    """Experts of the whole model (a rank may hold E / ep of them): the router's rows."""
    return params[stacked_name.rsplit(".experts.", 1)[0] + ".gate.weight"].shape[0]


def _resolve(
    name: str, params: dict[str, nn.Parameter], parts: dict[str, tuple[str, nn.Parameter, int]]
) -> tuple[nn.Parameter | None, int | None]:
    """The parameter a checkpoint tensor goes to, and which part of it (None: all of it)."""
    if name in parts:
        _, param, part = parts[name]
        return param, part
    m = _EXPERT.match(name)
    if m:
        suffix = "" if m.group(4) == "weight" else "_" + m.group(4)  # FP8 scales: ...experts.up_proj_weight_scale
        return params.get(f"{m.group(1)}.{m.group(3)}{suffix}"), int(m.group(2))
    return params.get(name), None


def _is_stacked_experts(name: str) -> bool:
    return _STACKED.search(name) is not None


def _per_expert_names(stacked_name: str, num_experts: int) -> list[str]:
    """`...experts.up_proj` -> the checkpoint's `...experts.{j}.up_proj.weight` names (FP8 scale stacks
    `...experts.up_proj_weight_scale` -> `...experts.{j}.up_proj.weight_scale`)."""
    m = _STACKED.search(stacked_name)
    base = stacked_name[: m.start()] + "experts"
    return [f"{base}.{j}.{m.group(1)}.{m.group(2) or 'weight'}" for j in range(num_experts)]


def _names_covered(name: str, part: int | None, target: nn.Parameter, model: nn.Module) -> list[str]:
    if part is None and _is_stacked_experts(name):  # stacked form in the checkpoint
        router = model.get_parameter(name.rsplit(".experts.", 1)[0] + ".gate.weight")
        return _per_expert_names(name, router.shape[0])
    return [name]
