"""The embedded tiny NemotronH checkpoint, checked against transformers' NemotronH (an oracle we did not write)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from service.engine.tokenizer import Tokenizer
from service.testing import tiny

transformers.logging.set_verbosity_error()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _read_json(folder: str, name: str) -> dict:
    def reject(constant: str) -> float:
        raise ValueError(f"{name} holds the non-standard JSON constant {constant}")

    with open(os.path.join(folder, name), encoding="utf-8") as f:
        return json.load(f, parse_constant=reject)


def _hf_name(name: str) -> str:
    return "model." + name[len("backbone.") :] if name.startswith("backbone.") else name


def _assert_transformers_loads_exactly(folder: str) -> transformers.PreTrainedModel:
    """No missing/unexpected keys, and every tensor transformers holds equals the file's."""
    model, info = transformers.NemotronHForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    file_tensors = load_file(os.path.join(folder, "model.safetensors"))
    expert_rows: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in file_tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            k = parts.index("experts")
            merged = _hf_name(".".join(parts[: k + 1] + parts[k + 2 : -1]))  # ...experts.up_proj
            expert_rows.setdefault(merged, {})[int(parts[k + 1])] = tensor
            continue
        torch.testing.assert_close(state[_hf_name(name)].detach(), tensor, rtol=0, atol=0, msg=name)
    for merged, rows in expert_rows.items():
        stacked = torch.stack([rows[j] for j in range(len(rows))])
        torch.testing.assert_close(state[merged].detach(), stacked, rtol=0, atol=0, msg=merged)
    return model.eval()


def test_config_values(model_dir):
    cfg = _read_json(model_dir, "config.json")
    tok = Tokenizer.from_model_path(model_dir)
    assert cfg["model_type"] == "nemotron_h" and cfg["architectures"] == ["NemotronHForCausalLM"]
    assert cfg["vocab_size"] % 8 == 0 and tok.vocab_size <= cfg["vocab_size"] < tok.vocab_size + 8
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>") == tok.eos_token_ids[0]
    assert cfg["bos_token_id"] == tok.token_to_id("<s>") and cfg["pad_token_id"] == tok.token_to_id("<|pad|>")
    assert all(math.isfinite(x) for x in cfg["time_step_limit"])
    hf_cfg = transformers.AutoConfig.from_pretrained(model_dir)
    assert set(hf_cfg.layers_block_type) == {"linear_attention", "full_attention", "moe", "mlp"}
    assert hf_cfg.num_hidden_layers == len(cfg["hybrid_override_pattern"]) == cfg["num_hidden_layers"]
    assert hf_cfg.layers_block_type[0] == "linear_attention"  # layer 0 is not attention
    assert _read_json(model_dir, "generation_config.json")["eos_token_id"] == cfg["eos_token_id"]


def test_loads_in_transformers_and_runs_forward(model_dir):
    model = _assert_transformers_loads_exactly(model_dir)
    tok = Tokenizer.from_model_path(model_dir)
    ids = torch.tensor([tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}]))])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_init_follows_nemotron_h_scheme(model_dir):
    cfg = _read_json(model_dir, "config.json")
    w = load_file(os.path.join(model_dir, "model.safetensors"))
    heads = cfg["mamba_num_heads"]
    inner = heads * cfg["mamba_head_dim"]
    conv_dim = inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    m = "backbone.layers.0.mixer."
    assert w[m + "in_proj.weight"].shape == (inner + conv_dim + heads, cfg["hidden_size"])
    assert w[m + "conv1d.weight"].shape == (conv_dim, 1, cfg["conv_kernel"])
    torch.testing.assert_close(w[m + "A_log"], torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
    assert torch.equal(w[m + "D"], torch.ones(heads)) and torch.equal(w[m + "norm.weight"], torch.ones(inner))
    dt = torch.nn.functional.softplus(w[m + "dt_bias"])
    assert (dt >= cfg["time_step_min"] * 0.999).all() and (dt <= cfg["time_step_max"] * 1.001).all()
    gate = "backbone.layers.3.mixer.gate."
    assert w[gate + "weight"].dtype == torch.float32 and w[gate + "e_score_correction_bias"].abs().min() > 0
    assert torch.equal(w["backbone.norm_f.weight"], torch.ones(cfg["hidden_size"]))
    assert not torch.equal(w["lm_head.weight"], w["backbone.embeddings.weight"])  # untied


def test_seed_changes_weights_not_tokenizer(model_dir, tmp_path):
    same = tiny.make_tiny_model(tmp_path / "same", seed=0)
    other = tiny.make_tiny_model(tmp_path / "other", seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        for folder in (same, other):
            with open(os.path.join(model_dir, name), "rb") as a, open(os.path.join(folder, name), "rb") as b:
                assert a.read() == b.read(), name
    w0, w_same, w1 = (load_file(os.path.join(d, "model.safetensors")) for d in (model_dir, same, other))
    assert all(torch.equal(w0[k], w_same[k]) for k in w0)
    assert not torch.equal(w0["lm_head.weight"], w1["lm_head.weight"])


def test_mamba_state_moves_the_logits(tmp_path):
    """With a mamba-only model, tokens beyond the conv window reach the output only through the SSM state."""
    model = _assert_transformers_loads_exactly(tiny.make_tiny_model(tmp_path, hybrid_override_pattern="MMMM"))
    gen = torch.Generator().manual_seed(0)
    tail = torch.randint(12, 1000, (1, 8), generator=gen)
    a = torch.cat([torch.randint(12, 1000, (1, 40), generator=gen), tail], dim=1)
    b = torch.cat([torch.randint(12, 1000, (1, 40), generator=gen), tail], dim=1)
    with torch.no_grad():
        la, lb = model(a, use_cache=False).logits[0, -1], model(b, use_cache=False).logits[0, -1]
    assert (la - lb).norm() / la.norm() > 0.02


def test_overrides_latent_moe_and_block_list(tmp_path):
    folder = tiny.make_tiny_model(
        tmp_path, moe_latent_size=16, layers_block_type=["mamba", "moe", "attention", "mlp", "moe"]
    )
    cfg = _read_json(folder, "config.json")
    assert "hybrid_override_pattern" not in cfg and cfg["num_hidden_layers"] == 5
    w = load_file(os.path.join(folder, "model.safetensors"))
    assert w["backbone.layers.1.mixer.fc1_latent_proj.weight"].shape == (16, 64)
    assert w["backbone.layers.4.mixer.experts.7.up_proj.weight"].shape == (32, 16)
    assert w["backbone.layers.1.mixer.shared_experts.up_proj.weight"].shape == (32, 64)
    model = _assert_transformers_loads_exactly(folder)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[5, 100, 200, 300]])).logits).all()


def test_bad_overrides_are_named(tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        tiny.make_tiny_model(tmp_path, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="hybrid_override_pattern"):
        tiny.make_tiny_model(tmp_path, hybrid_override_pattern="MX")


def test_add_cli_through_argparse(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="hybrid-serve")
    tiny.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["make-tiny-model", str(tmp_path / "m"), "--seed", "3"])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("service.engine.generate_cli", "service.deployments.serve_cli")),
    reason="service/cli.py imports subcommand modules that do not exist yet",
)
def test_cli_module_entry_point(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "make-tiny-model", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert (out / "model.safetensors").is_file()
