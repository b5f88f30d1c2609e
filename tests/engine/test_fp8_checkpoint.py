"""ModelOpt-format FP8 checkpoints: a transformers-written BF16-family checkpoint quantized by our script, loaded and
served by the engine, against a plain engine on the dequantized weights; loader and config errors."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from service.engine import Engine, EngineConfig, SamplingParams
from service.engine.kernels import fp8 as fp8_kernels
from service.engine.model.quant import parse_quant_config, read_quant_config
from service.testing.quantize_fp8 import quantize_checkpoint, random_calibration
from tests.engine.helpers import full_prefill_logits, random_ids

VARIANTS = ("mixed_g2_c16", "latent_g1_c8")  # M*ME-M (MoE + dense MLP) and ME*M-E (latent MoE)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write(path: str, tensors: dict[str, torch.Tensor], src: str, quant: dict | None) -> str:
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if quant is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(quant, f)
    return path


def dequantized(fp8_dir: str, out: str) -> str:
    """An unquantized checkpoint holding weight * weight_scale for every FP8 tensor (the FP8 model's exact weights)."""
    t = _tensors(fp8_dir)
    plain = {k: v for k, v in t.items() if not k.endswith(("weight_scale", "input_scale"))}
    for k, v in t.items():
        if v.dtype == torch.float8_e4m3fn:
            plain[k] = v.float() * t[k[: -len("weight")] + "weight_scale"]
    return _write(out, plain, fp8_dir, None)


@pytest.fixture(scope="module")
def fp8_pair(hf_checkpoints, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """variant -> (FP8 checkpoint quantized by our script, its dequantized unquantized twin)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for v in VARIANTS:
        fp8 = quantize_checkpoint(hf_checkpoints[v], str(root / v), ("lm_head",), random_calibration(256, 6, 48))
        out[v] = (fp8, dequantized(fp8, str(root / f"{v}_deq")))
    return out


def engine(path: str) -> Engine:
    return Engine(EngineConfig(model_path=path, max_num_seqs=4, max_model_len=256, page_size=4))


def test_quantized_checkpoint_has_the_modelopt_layout(fp8_pair):
    fp8, _ = fp8_pair["mixed_g2_c16"]
    t = _tensors(fp8)
    q = read_quant_config(fp8)
    assert (q.quant_algo, q.kv_cache_quant_algo, q.exclude_modules) == ("FP8", None, ("lm_head",))
    w = t["backbone.layers.0.mixer.in_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and w.float().abs().max() == 448.0  # amax maps to the e4m3 maximum
    for name in (
        "backbone.layers.0.mixer.in_proj",
        "backbone.layers.1.mixer.q_proj",
        "backbone.layers.3.mixer.experts.3.up_proj",
        "backbone.layers.3.mixer.shared_experts.down_proj",
        "backbone.layers.4.mixer.up_proj",
    ):
        assert t[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
        assert t[f"{name}.weight_scale"].dtype == torch.float32 and t[f"{name}.weight_scale"].numel() == 1
        assert t[f"{name}.input_scale"].dtype == torch.float32 and t[f"{name}.input_scale"] > 0
    assert t["lm_head.weight"].dtype == torch.float32 and "lm_head.weight_scale" not in t
    assert t["backbone.layers.0.mixer.conv1d.weight"].dtype == torch.float32
    assert t["backbone.layers.3.mixer.gate.weight"].dtype == torch.float32


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_logits_match_the_dequantized_model(fp8_pair, variant):
    """The torch bundle runs FP8 weights weight-only: equal to the unquantized model on the dequantized weights up to
    rounding and the fused q/k/v requantization to one scale."""
    fp8, deq = fp8_pair[variant]
    a, b = engine(fp8), engine(deq)
    model = a.runner.model
    assert (
        model.backbone.layers[0 if variant == "mixed_g2_c16" else 3].mixer.in_proj.weight.dtype == torch.float8_e4m3fn
    )
    assert any(
        getattr(layer.mixer, "experts", None) is not None and layer.mixer.experts.up_proj.dtype == torch.float8_e4m3fn
        for layer in model.backbone.layers
    )
    for seed in range(3):
        ids = random_ids(40, seed=100 + seed)
        la, lb = full_prefill_logits(a, ids), full_prefill_logits(b, ids)
        rel = ((la - lb).norm() / lb.norm()).item()
        assert rel < 1e-2, rel
        assert (la - lb).abs().max() < 2e-3  # and per logit: what the peaked-prompt test relies on


def test_fp8_static_activation_path_on_the_scaled_mm_linear(fp8_pair):
    """The Triton bundle's dense op, torch._scaled_mm (runs on CPU too; the tiny in_proj has N=200, so padding is
    exercised), quantizing activations with the checkpoint's static input scales: close to, not equal to, the
    dequantized model (e4m3 activation rounding, ~2-3% per element, through 6 layers)."""
    fp8, deq = fp8_pair["mixed_g2_c16"]
    a, b = engine(fp8), engine(deq)
    a.runner.model.kernels = dataclasses.replace(a.runner.model.kernels, fp8_linear=fp8_kernels.fp8_linear)
    ids = random_ids(40, seed=7)
    la, lb = full_prefill_logits(a, ids), full_prefill_logits(b, ids)
    rel = ((la - lb).norm() / lb.norm()).item()
    assert 1e-3 < rel < 0.2, rel
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.7


def test_fp8_greedy_tokens_equal_on_peaked_prompts(fp8_pair):
    """Prompts whose reference next-token logits are peaked (top-1 ahead of top-2 by >= 0.02 nats at every step,
    well above the logit differences of the weight-only path): the FP8 engine picks the same greedy tokens."""
    fp8, deq = fp8_pair["mixed_g2_c16"]
    a, b = engine(fp8), engine(deq)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    prompts = [random_ids(24, seed=s) for s in range(24)]
    ref = b.generate(prompts, params)
    peaked = [
        i
        for i, o in enumerate(ref)
        if all(sorted(d.values())[-1] - sorted(d.values())[-2] >= 0.02 for d in o.top_logprobs)
    ]
    assert len(peaked) >= 6, len(peaked)
    got = a.generate([prompts[i] for i in peaked], params)
    assert [o.token_ids for o in got] == [ref[i].token_ids for i in peaked]


def test_fp8_checkpoint_serves_requests(fp8_pair):
    e = engine(fp8_pair["latent_g1_c8"][0])
    outs = e.generate(
        [random_ids(n, seed=n) for n in (5, 17, 33)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    assert [len(o.token_ids) for o in outs] == [8, 8, 8]


def test_missing_scale_is_a_clear_error(fp8_pair, tmp_path):
    fp8, _ = fp8_pair["mixed_g2_c16"]
    t = _tensors(fp8)
    del t["backbone.layers.3.mixer.experts.5.down_proj.weight_scale"]
    path = _write(str(tmp_path / "broken"), t, fp8, json.load(open(os.path.join(fp8, "hf_quant_config.json"))))
    with pytest.raises(ValueError, match=r"missing tensors.*experts\.5\.down_proj\.weight_scale"):
        engine(path)


def test_fp8_weight_without_a_quant_config_is_a_clear_error(fp8_pair, tmp_path):
    fp8, _ = fp8_pair["mixed_g2_c16"]
    path = _write(str(tmp_path / "noconfig"), _tensors(fp8), fp8, None)
    with pytest.raises(ValueError, match="float8_e4m3fn.*quantization config|unexpected tensors.*weight_scale"):
        engine(path)


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}, "quant_algo 'NVFP4' is not supported"),
        ({"quant_method": "modelopt", "quant_algo": "FP8_PB_WO"}, "quant_algo 'FP8_PB_WO' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method 'fp8' is not supported"),
        ({"quantization": {"quant_algo": "FP8", "block_size": 128}}, "per-block FP8"),
        ({"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}}, "kv_cache_quant_algo 'INT8'"),
    ],
)
def test_unsupported_schemes_name_what_is_supported(raw, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_quant_config(raw, "hf_quant_config.json")
    assert "ModelOpt FP8" in str(err.value) or "FP8 or none" in str(err.value)


def test_unknown_quant_algo_in_a_model_folder_fails_at_engine_start(fp8_pair, tmp_path):
    fp8, _ = fp8_pair["mixed_g2_c16"]
    path = _write(str(tmp_path / "w4"), _tensors(fp8), fp8, {"quantization": {"quant_algo": "W4A8_AWQ"}})
    with pytest.raises(ValueError, match="W4A8_AWQ.*supported"):
        engine(path)


def test_config_json_quantization_config_and_exclusion_patterns():
    q = parse_quant_config(
        {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False},
            "ignore": ["lm_head", "backbone.layers.4.mixer*", "*.q_proj"],
        },
        "config.json",
    )
    assert q.kv_cache_quant_algo == "FP8"
    assert q.excluded("lm_head") and q.excluded("backbone.layers.4.mixer.in_proj")
    assert q.excluded("backbone.layers.7.mixer.q_proj") and not q.excluded("backbone.layers.7.mixer.k_proj")
    assert not q.excluded("backbone.layers.40.mixer.in_proj")
