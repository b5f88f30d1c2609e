"""Benchmark model folders: a published NemotronH config.json and a tokenizer built here, no weights.

`make_model_dir(out, "nano" | "super" | path, quantization)` writes `config.json` (the published Nano-30B-A3B or
Super-120B-A12B config, or any HF config.json), `generation_config.json`, `tokenizer.json` and
`tokenizer_config.json`, and with `quantization="fp8"` an `hf_quant_config.json` in ModelOpt's layout. Serve it with
`--load-format dummy`: the weights are drawn on the device (model/dummy.py).

The tokenizer is the embedded byte-level BPE of `model.tiny` (trained on our synthetic corpus, chat template
included) with its vocabulary filled up to the config's `vocab_size` by plain lower-case ASCII tokens (" ab",
"qzx", ...): encoding uses only the trained merges, and every id in [0, vocab_size) decodes to text.

The FP8 exclusion list follows the published ModelOpt recipes (as documented for the NVIDIA checkpoints): the
output layer, every attention projection, the latent MoE projections, and for Nano the in_proj/out_proj of each
Mamba layer that directly precedes an attention layer stay BF16; the embeddings, conv1d and router are never
quantized here. KV cache quantization is left off unless asked for.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import string
from typing import Any

from tokenizers import Tokenizer

from service.engine.config import parse_layer_types
from service.engine.model.quant import QuantConfig
from service.testing.tiny import tokenizer_config, train_tokenizer

PUBLISHED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published")
PUBLISHED = {"nano": "nano_30b_a3b.json", "super": "super_120b_a12b.json"}  # --config name -> file


def published_config(name_or_path: str) -> dict[str, Any]:
    """The config.json dict for 'nano', 'super' or a path to an HF config.json."""
    path = os.path.join(PUBLISHED_DIR, PUBLISHED[name_or_path]) if name_or_path in PUBLISHED else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"--config must be one of {sorted(PUBLISHED)} or a config.json path; {path!r} does not exist")
    with open(path) as f:
        return json.load(f)


def _filler_tokens() -> itertools.chain:
    """Lower-case ASCII strings, shortest first, with and without a leading space (byte-level 'Ġ')."""
    for n in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=n):
            word = "".join(letters)
            yield word
            yield "\u0120" + word


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer_json() -> str:
    """The embedded BPE tokenizer (deterministic: trained once per process)."""
    return train_tokenizer().to_str()


def covering_tokenizer(vocab_size: int) -> Tokenizer:
    """The embedded BPE tokenizer with its vocabulary filled up to exactly `vocab_size` ids (every id decodes)."""
    base = Tokenizer.from_str(_embedded_tokenizer_json())
    if base.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is smaller than the embedded tokenizer's "
            f"{base.get_vocab_size(with_added_tokens=True)} tokens"
        )
    spec = json.loads(base.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in spec["added_tokens"]}
    used_ids = set(vocab.values()) | {t["id"] for t in spec["added_tokens"]}
    free_ids = (i for i in range(vocab_size) if i not in used_ids)
    fillers = (t for t in _filler_tokens() if t not in taken)
    for token_id, token in zip(free_ids, fillers):
        vocab[token] = token_id
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    if tokenizer.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(
            f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}"
        )
    return tokenizer


def fp8_exclusions(config: dict[str, Any]) -> tuple[str, ...]:
    """exclude_modules of the published FP8 recipes for this config (see the module docstring)."""
    letters = parse_layer_types(config) or ()
    out = ["lm_head", "*.mixer.q_proj", "*.mixer.k_proj", "*.mixer.v_proj", "*.mixer.o_proj"]
    if config.get("moe_latent_size"):
        out += ["*.mixer.fc1_latent_proj", "*.mixer.fc2_latent_proj"]
    else:
        for i in range(len(letters) - 1):
            if letters[i] == "M" and letters[i + 1] == "*":
                out += [f"backbone.layers.{i}.mixer.in_proj", f"backbone.layers.{i}.mixer.out_proj"]
    return tuple(out)


def make_model_dir(
    out_dir: str,
    config: str = "nano",
    quantization: str = "none",
    kv_cache_fp8: bool = False,
    overrides: dict[str, Any] | None = None,
) -> str:
    """Writes the folder (created if missing) and returns its path. overrides: config.json keys to replace."""
    if quantization not in ("none", "fp8"):
        raise ValueError(f"quantization must be 'none' or 'fp8', got {quantization!r}")
    cfg = {**published_config(config), **(overrides or {})}
    cfg.pop("quantization_config", None)
    tokenizer = covering_tokenizer(int(cfg["vocab_size"]))
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {**tokenizer_config(tokenizer), "model_max_length": int(cfg.get("max_position_embeddings", 4096))}
    files: dict[str, Any] = {
        "config.json": cfg,
        "tokenizer_config.json": tok_cfg,
        "generation_config.json": {
            "bos_token_id": cfg.get("bos_token_id"),
            "eos_token_id": cfg.get("eos_token_id"),
            "pad_token_id": cfg.get("pad_token_id"),
        },
    }
    if quantization == "fp8":
        files["hf_quant_config.json"] = QuantConfig(
            "FP8", "FP8" if kv_cache_fp8 else None, fp8_exclusions(cfg)
        ).to_hf_quant_config()
    elif os.path.exists(os.path.join(out_dir, "hf_quant_config.json")):
        os.remove(os.path.join(out_dir, "hf_quant_config.json"))
    for name, payload in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return out_dir


def _run_cli(args: argparse.Namespace) -> int:
    print(make_model_dir(args.out, args.config, args.quantization, args.kv_cache_fp8))
    return 0


def add_cli(subparsers: Any) -> None:
    """Register `make-model-dir OUT --config nano|super|PATH [--quantization none|fp8] [--kv-cache-fp8]`."""
    p = subparsers.add_parser(
        "make-model-dir",
        help="write a weightless model folder (published config + our tokenizer) to serve with --load-format dummy",
    )
    p.add_argument("out", metavar="OUT", help="output folder (created if missing)")
    p.add_argument("--config", default="nano", help="'nano', 'super' or the path of an HF config.json")
    p.add_argument(
        "--quantization",
        default="none",
        choices=("none", "fp8"),
        help="fp8: also write a ModelOpt FP8 hf_quant_config.json (the published recipe's exclusions)",
    )
    p.add_argument("--kv-cache-fp8", action="store_true", help="with --quantization fp8: kv_cache_quant_algo FP8")
    p.set_defaults(func=_run_cli)
