"""Quantize an unquantized NemotronH checkpoint into NVIDIA ModelOpt's FP8 layout (per-tensor, static scales).

`quantize_checkpoint(src, dst, exclude_modules, calibration, kv_cache_fp8=False)`:
1. calibration: our engine runs the source checkpoint (torch reference kernels) over the calibration token lists
   with a recording kernel bundle that keeps, for every linear, the largest |activation| entering it (per expert
   for the routed experts: over the tokens routed to that expert), and for every attention layer the largest |K|
   and |V| written to its KV cache;
2. every linear not excluded gets weight = e4m3(W / weight_scale) with weight_scale = max|W| / 448 and
   input_scale = max|x| / 448, under the checkpoint's own names (`...q_proj.weight_scale`,
   `...experts.{j}.up_proj.input_scale`, ...); with kv_cache_fp8 every attention layer gets `k_proj.k_scale` =
   max|K| / 448 and `v_proj.v_scale` = max|V| / 448 (the FP8 KV cache's per-layer scales); every other tensor is
   copied unchanged;
3. `dst` gets model.safetensors, hf_quant_config.json (quant_algo FP8; kv_cache_quant_algo FP8 with kv_cache_fp8,
   else none), config.json and the tokenizer / generation files of `src`.
`hybrid-serve quantize-fp8 SRC OUT [--exclude PATTERN ...] [--kv-cache-fp8]` runs it with random-token calibration
prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from service.engine.kernels import Kernels, attention, norm, torch_kernels
from service.engine.kernels.fp8 import FP8_MAX, quantize_fp8
from service.engine.kernels.moe import relu2
from service.engine.model.quant import QuantConfig, fused_parts
from service.engine.model.weights import checkpoint_files

LINEAR_LEAVES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj",
    "out_proj",
    "up_proj",
    "down_proj",
    "fc1_latent_proj",
    "fc2_latent_proj",
    "lm_head",
)
COPIED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


class ActivationRecorder:
    """Largest |input| per weight tensor (keyed by the weight's data pointer; per expert for stacked experts)."""

    def __init__(self) -> None:
        self.amax: dict[tuple[int, int], float] = {}  # (weight data_ptr, expert or -1) -> max |x|

    def see(self, weight: torch.Tensor, x: torch.Tensor, expert: int = -1) -> None:
        if x.numel():
            key = (weight.data_ptr(), expert)
            self.amax[key] = max(self.amax.get(key, 0.0), float(x.detach().abs().max()))

    def linear(self, x, weight, bias=None):
        self.see(weight, x)
        return F.linear(x, weight, bias)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps, weight, bias=None):
        normed, new_residual = norm.add_rms_norm_ref(x, residual, norm_weight, eps)
        return self.linear(normed, weight, bias), new_residual

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scale=None, v_scale=None):
        self.see(k_cache, k)  # keyed by the layer's cache view
        self.see(v_cache, v)
        attention.write_kv_ref(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)

    def gated_norm_linear(self, y, z, norm_weight, group_size, eps, weight, bias=None):
        return self.linear(
            norm.gated_group_rms_norm_ref(y, z, norm_weight, group_size, eps, weight.dtype), weight, bias
        )

    def moe_experts(self, x, up, down, topk_weights, topk_ids, *, shared_up=None, shared_down=None):
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        for e in range(up.shape[0]):
            rows, slots = (topk_ids == e).nonzero(as_tuple=True)
            if rows.numel():
                self.see(up, x[rows], e)
                h = relu2(F.linear(x[rows], up[e]))
                self.see(down, h, e)
                out.index_add_(0, rows, F.linear(h, down[e]).float() * topk_weights[rows, slots, None])
        if shared_up is not None:
            out += self.linear(relu2(self.linear(x, shared_up)), shared_down).float()
        return out.to(x.dtype)

    def kernels(self) -> Kernels:
        return dataclasses.replace(
            torch_kernels(),
            name="torch",
            linear=self.linear,
            add_rms_norm_linear=self.add_rms_norm_linear,
            gated_norm_linear=self.gated_norm_linear,
            moe_experts=self.moe_experts,
            write_kv=self.write_kv,
        )


def calibrate(src: str, calibration: list[list[int]]) -> dict[str, float]:
    """Checkpoint module name (`backbone.layers.3.mixer.in_proj`, `...experts.5.up_proj`) -> max |input| seen;
    attention layer `backbone.layers.1.mixer` -> `...mixer.k_proj.k_scale` / `...mixer.v_proj.v_scale`: max |K| /
    |V| written to its KV cache."""
    from service.engine import Engine, EngineConfig, SamplingParams

    engine = Engine(
        EngineConfig(
            model_path=src,
            device="cpu",  # the torch kernels the recorder wraps, on any machine
            dtype="float32",
            max_num_seqs=max(1, len(calibration)),
            max_model_len=max(map(len, calibration)) + 8,
        )
    )
    recorder = ActivationRecorder()
    engine.runner.model.kernels = recorder.kernels()
    engine.runner.model.skip_rows = False  # the trailing layers too see every prompt token, not just the last
    engine.generate(calibration, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    model = engine.runner.model
    fused = {f"{name}.weight": parts for name, parts in fused_parts(model).items()}
    out: dict[str, float] = {}
    kv = engine.runner.pools.kv  # [L_attn, 2, slots, Hkv, Dh]
    for j, lid in enumerate(model.cfg.attention_layer_ids):
        for i, name in enumerate(("k_proj.k_scale", "v_proj.v_scale")):
            out[f"backbone.layers.{lid}.mixer.{name}"] = recorder.amax.get((kv[j, i].data_ptr(), -1), 0.0)
    for name, p in model.named_parameters():
        for (ptr, expert), amax in recorder.amax.items():
            if ptr != p.data_ptr():
                continue
            if expert >= 0:  # ...experts.up_proj -> ...experts.{e}.up_proj
                base, proj = name.rsplit(".", 1)
                out[f"{base}.{expert}.{proj}"] = amax
            else:
                for part in fused.get(name, [name[: -len(".weight")]]):
                    out[part] = amax
    return out


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors (`...experts.up_proj` [E, I, d]) split into ModelOpt's per-expert
    `...experts.{j}.up_proj.weight`; everything else as is."""
    out: dict[str, torch.Tensor] = {}
    for raw, t in tensors.items():
        base, _, proj = raw.rpartition(".")
        if base.endswith("experts") and proj in ("up_proj", "down_proj") and t.dim() == 3:
            out.update({f"{base}.{j}.{proj}.weight": t[j] for j in range(t.shape[0])})
        else:
            out[raw] = t
    return out


def _qkv_amax(
    tensors: dict[str, torch.Tensor], canonical: dict[str, str], quantized: set[str]
) -> dict[str, torch.Tensor]:
    """q_proj / k_proj / v_proj module -> max |W| over the three of its attention layer: they share one weight
    scale, as the engine fuses them into one projection (no requantization at load)."""
    amax: dict[str, torch.Tensor] = {}
    for raw, t in tensors.items():
        module = canonical[raw].rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        if module in quantized and leaf in ("q_proj", "k_proj", "v_proj"):
            amax[parent] = torch.maximum(amax.get(parent, torch.tensor(0.0)), t.float().abs().max())
    return {f"{parent}.{leaf}": v for parent, v in amax.items() for leaf in ("q_proj", "k_proj", "v_proj")}


def _quantized_modules(names: list[str], quant: QuantConfig) -> set[str]:
    """Checkpoint module names whose `.weight` gets quantized: linears (2-D weights) not excluded."""
    out = set()
    for name in names:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEAR_LEAVES and not quant.excluded(module):
            out.add(module)
    return out


def quantize_checkpoint(
    src: str,
    dst: str,
    exclude_modules: tuple[str, ...],
    calibration: list[list[int]],
    kv_cache_fp8: bool = False,
) -> str:
    """Writes the FP8 checkpoint of `src` into `dst` (see the module docstring); returns dst."""
    quant = QuantConfig("FP8", "FP8" if kv_cache_fp8 else None, tuple(exclude_modules))
    amax = calibrate(src, calibration)
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(src):
        with safe_open(path, framework="pt") as f:
            for raw in f.keys():
                tensors[raw] = f.get_tensor(raw)
    tensors = _per_expert(tensors)
    canonical = {raw: ("backbone." + raw[len("model.") :] if raw.startswith("model.") else raw) for raw in tensors}
    quantized = _quantized_modules(list(canonical.values()), quant)
    shared_amax = _qkv_amax(tensors, canonical, quantized)
    out: dict[str, torch.Tensor] = {}
    for raw, t in tensors.items():
        module = canonical[raw].rpartition(".")[0]
        if module not in quantized or t.dim() != 2:
            out[raw] = t.contiguous()
            continue
        if module not in amax:
            raise ValueError(f"calibration never reached {module!r}: give prompts that route tokens to every expert")
        w_scale = (shared_amax.get(module, t.float().abs().max()) / FP8_MAX).clamp(min=1e-12)
        base = raw.rpartition(".")[0]
        out[raw] = quantize_fp8(t, w_scale).contiguous()
        out[f"{base}.weight_scale"] = w_scale.reshape(())
        out[f"{base}.input_scale"] = torch.tensor(max(amax[module], 1e-6) / FP8_MAX, dtype=torch.float32)
    if kv_cache_fp8:
        out.update(_kv_scales(tensors, canonical, amax))
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        json.dump(quant.to_hf_quant_config(), f, indent=2)
    return dst


def _kv_scales(
    tensors: dict[str, torch.Tensor], canonical: dict[str, str], amax: dict[str, float]
) -> dict[str, torch.Tensor]:
    """`...k_proj.k_scale` / `...v_proj.v_scale` (named with the checkpoint's own prefix) = calibrated max / 448."""
    out = {}
    for raw in tensors:
        for proj, scale in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            if raw.endswith(f".{proj}.weight"):
                key = f"{canonical[raw].rpartition('.')[0]}.{scale}"
                out[f"{raw.rpartition('.')[0]}.{scale}"] = torch.tensor(max(amax[key], 1e-6) / FP8_MAX)
    return out


def random_calibration(vocab_size: int, num_prompts: int = 8, length: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num_prompts, length), generator=g).tolist()


def _run_cli(args: argparse.Namespace) -> int:
    with open(os.path.join(args.src, "config.json")) as f:
        vocab = int(json.load(f)["vocab_size"])
    print(
        quantize_checkpoint(
            args.src,
            args.out,
            tuple(args.exclude),
            random_calibration(vocab, args.calibration_prompts, args.calibration_len),
            args.kv_cache_fp8,
        )
    )
    return 0


def add_cli(subparsers: Any) -> None:
    """Register `quantize-fp8 SRC OUT [--exclude PATTERN ...]`."""
    p = subparsers.add_parser("quantize-fp8", help="write a ModelOpt-format FP8 copy of an unquantized checkpoint")
    p.add_argument("src", metavar="SRC", help="unquantized checkpoint folder")
    p.add_argument("out", metavar="OUT", help="output folder (created if missing)")
    p.add_argument(
        "--exclude",
        action="append",
        default=["lm_head"],
        help="module-name pattern kept unquantized (repeat; default: lm_head)",
    )
    p.add_argument(
        "--kv-cache-fp8",
        action="store_true",
        help="also calibrate per-layer k_scale / v_scale and mark the checkpoint's KV cache FP8",
    )
    p.add_argument("--calibration-prompts", type=int, default=8, help="random-token calibration prompts")
    p.add_argument("--calibration-len", type=int, default=64, help="tokens per calibration prompt")
    p.set_defaults(func=_run_cli)
