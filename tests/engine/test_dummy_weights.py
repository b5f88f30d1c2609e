"""Dummy weights (`load_format="dummy"`) and weightless model folders (`make-model-dir`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from service.engine import Engine, EngineConfig
from service.engine.tokenizer import Tokenizer
from service.testing.model_dir import fp8_exclusions, make_model_dir, published_config
from tests.engine.helpers import full_prefill_logits, greedy, random_ids


def shrunk(name: str, per_kind: int = 2, experts: int = 8, narrow: int = 1) -> dict:
    """The published config with `per_kind` layers of each layer kind (in the published order of first appearance),
    `experts` routed experts (top-k capped at 4) and a 2K vocabulary; narrow > 1 divides the hidden size, the head
    counts and every intermediate width by it (head_dim, state size, groups and KV heads stay)."""
    cfg = published_config(name)
    pattern = cfg["hybrid_override_pattern"]
    kinds = sorted(set(pattern), key=pattern.index)
    cfg["hybrid_override_pattern"] = "".join(k for _ in range(per_kind) for k in kinds)
    cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    cfg.update(vocab_size=2048, n_routed_experts=experts, num_experts_per_tok=min(4, cfg["num_experts_per_tok"]))
    for key in (
        "hidden_size",
        "mamba_num_heads",
        "num_attention_heads",
        "intermediate_size",
        "moe_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "moe_latent_size",
    ):
        if cfg.get(key):
            cfg[key] //= narrow
    return cfg


def write_config_dir(path, cfg: dict, quant: dict | None = None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if quant is not None:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(quant, f)
    return str(path)


@pytest.mark.parametrize("name", ["nano", "super"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("narrow", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_dummy_weights_give_finite_varied_logits_on_published_shapes(tmp_path, name, fmt, narrow):
    """Published widths (slow: ~40 s each on 2 shared cores) and a 4x narrower bounded version."""
    cfg = shrunk(name, narrow=narrow)
    quant = None
    if fmt == "fp8":
        quant = {
            "producer": {"name": "modelopt"},
            "quantization": {
                "quant_algo": "FP8",
                "kv_cache_quant_algo": None,
                "exclude_modules": list(fp8_exclusions(cfg)),
            },
        }
    path = write_config_dir(tmp_path / name, cfg, quant)
    engine = Engine(
        EngineConfig(
            model_path=path, load_format="dummy", dtype="bfloat16", max_num_seqs=2, max_model_len=64, page_size=16
        )
    )
    model = engine.runner.model
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    if fmt == "fp8":  # experts, shared experts and the Mamba projections not excluded are FP8; attention is not
        assert any(n.endswith("experts.up_proj") for n in fp8) and any("shared_experts" in n for n in fp8)
        assert any(n.endswith("in_proj.weight") for n in fp8) and not any("qkv_proj" in n for n in fp8)
        assert "lm_head.weight" not in fp8
    else:
        assert not fp8
    logits = full_prefill_logits(engine, random_ids(12, seed=3, vocab=cfg["vocab_size"]))
    assert torch.isfinite(logits).all()
    # not degenerate: positions differ and each row has spread (a NaN-free but constant model would pass isfinite)
    assert logits.std(dim=-1).min() > 0.1 and (logits[0] - logits[-1]).abs().max() > 0.1


def tiny_dummy(path: str, seed: int) -> Engine:
    return Engine(EngineConfig(model_path=path, load_format="dummy", seed=seed, max_num_seqs=2, max_model_len=128))


def test_dummy_weights_are_deterministic_by_seed(tiny_model_dir):
    a, b, c = (dict(tiny_dummy(tiny_model_dir, s).runner.model.named_parameters()) for s in (7, 7, 8))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    drawn = [n for n in a if a[n].dim() >= 2]
    assert all(not torch.equal(a[n], c[n]) for n in drawn)
    # the checkpoint's weights are not what was loaded
    ckpt = Engine(EngineConfig(model_path=tiny_model_dir, max_num_seqs=2, max_model_len=128)).runner.model
    assert not torch.equal(ckpt.lm_head.weight, a["lm_head.weight"])


def test_covering_tokenizer_decodes_every_id(tmp_path):
    out = make_model_dir(str(tmp_path / "nano"), "nano")
    assert json.load(open(os.path.join(out, "config.json"))) == published_config("nano")
    tok = Tokenizer.from_model_path(out)
    raw = tok._tk
    vocab_size = published_config("nano")["vocab_size"]
    assert raw.get_vocab_size(with_added_tokens=True) == vocab_size
    assert all(raw.id_to_token(i) is not None for i in range(vocab_size))
    assert tok.decode([vocab_size - 1]).strip() and tok.decode([1000, 5000, 70000]).count(" ") >= 1
    text = "The cat sees 12 + 3 = 15 in Paris."
    assert tok.decode(tok.encode(text)) == text  # encoding uses the trained merges and round-trips
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    assert not os.path.exists(os.path.join(out, "hf_quant_config.json"))


def test_make_model_dir_fp8_writes_the_published_exclusions(tmp_path):
    out = make_model_dir(str(tmp_path / "nano8"), "nano", "fp8")
    q = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
    assert q["quant_algo"] == "FP8" and "lm_head" in q["exclude_modules"]
    # Nano: the Mamba layers right before each attention layer keep BF16 in_proj/out_proj
    assert [m for m in q["exclude_modules"] if m.endswith("in_proj")] == [
        f"backbone.layers.{i}.mixer.in_proj" for i in (4, 11, 18, 25, 32, 41)
    ]
    sup = json.load(open(os.path.join(make_model_dir(str(tmp_path / "s8"), "super", "fp8"), "hf_quant_config.json")))[
        "quantization"
    ]["exclude_modules"]
    assert "*.mixer.fc1_latent_proj" in sup and not any(m.endswith("in_proj") for m in sup)


def test_make_model_dir_then_generate_with_dummy_weights_through_the_cli(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "hybrid-serve")
    cfg_path = tmp_path / "small.json"
    cfg = shrunk("nano", per_kind=1, experts=6)
    cfg.update(
        hidden_size=256,
        mamba_num_heads=8,
        n_groups=2,
        ssm_state_size=16,
        intermediate_size=128,
        moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=128,
        num_attention_heads=4,
        head_dim=32,
        vocab_size=1536,
    )
    cfg_path.write_text(json.dumps(cfg))
    out = str(tmp_path / "dir")
    res = subprocess.run(
        [exe, "make-model-dir", out, "--config", str(cfg_path)], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [
            exe,
            "generate",
            "--model-path",
            out,
            "--load-format",
            "dummy",
            "--prompt",
            "Hello there",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    line = json.loads(next(l for l in res.stdout.splitlines() if l.startswith("{")))
    assert len(line["token_ids"]) == 5 and all(0 <= t < 1536 for t in line["token_ids"])


def test_engine_generates_with_dummy_weights_in_bf16_and_fp8(tmp_path, tiny_model_dir):
    """The tiny model's config, dummy weights, FP8 (everything but lm_head quantized) vs BF16: both generate."""
    cfg = json.load(open(os.path.join(tiny_model_dir, "config.json")))
    quant = {"quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    for q in (None, quant):
        path = write_config_dir(tmp_path / ("fp8" if q else "bf16"), cfg, q)
        out = Engine(EngineConfig(model_path=path, load_format="dummy", max_num_seqs=2, max_model_len=128)).generate(
            [[5, 6, 7, 8]], greedy(4)
        )[0]
        assert len(out.token_ids) == 4
