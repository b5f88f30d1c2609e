"""An embedded tiny NemotronH checkpoint, built entirely by our code (no hub downloads).

`make_tiny_model(out_dir, seed)` writes a folder shaped like a real HF NemotronH checkpoint:
`config.json`, `generation_config.json`, `model.safetensors` (original NVIDIA tensor names under
`backbone.`, fp32), `tokenizer.json` (byte-level BPE trained here on a deterministic synthetic
corpus) and `tokenizer_config.json` (ChatML chat template in the Nemotron-3 style).

The tokenizer does not depend on `seed`; the weights do. Weights follow transformers'
`NemotronHPreTrainedModel._init_weights` (normal(0, initializer_range) linears/embeddings, norms 1,
A_log = log(1..H), D = 1, dt_bias = softplus^-1 of log-uniform dt, out_proj kaiming/sqrt(layers))
with three deliberate differences so that every path visibly matters in a 64-wide model:
- `initializer_range` is 0.1 (~1/sqrt(hidden)); 0.02 suits hidden ~2500, and at hidden 64 it made
  the SSM state move the logits by only ~0.5%;
- the depthwise conv keeps PyTorch's `nn.Conv1d` default (uniform +-1/sqrt(K) weight and bias), as
  the original Mamba-2 code does;
- the MoE `e_score_correction_bias` is normal(0, 0.1), which changes the top-k for ~half the tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from service.engine.config import parse_layer_types

# (content, special): special tokens are dropped by skip_special_tokens; the reasoning/tool markers
# are added tokens that stay in decoded text, so reasoning and tool-call parsers can see them.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<unk>", True),
    ("<s>", True),
    ("</s>", True),
    ("<|pad|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
TOKENIZER_VOCAB_SIZE = 1000  # target BPE vocab incl. special tokens and the 256-byte alphabet
_CORPUS_SEED = 1234  # the tokenizer is the same for every weight seed

# ChatML in the Nemotron-3 style. Written with explicit string pieces so trim/lstrip_blocks never
# change the output. Tool-call arguments must be JSON objects (dicts), not JSON strings.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}"
    "{%- if part is mapping and part.type == 'text' -%}{{- part.text -}}"
    "{%- else -%}{{- raise_exception('only text content parts are supported') -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- elif content is none -%}"
    "{%- else -%}{{- raise_exception('message content must be a string or a list of text parts') -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_tools(tools) -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query. '"
    " ~ 'The available functions, as JSON schemas:\\n\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\n\\nTo call a function, reply in exactly this format:\\n<tool_call>\\n<function=NAME>\\n'"
    " ~ '<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' -}}"
    "{%- endmacro -%}"
    "{%- macro render_tool_call(call) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if fn.arguments is defined and fn.arguments is string -%}"
    "{{- raise_exception('tool_calls arguments must be a JSON object, not a string') -}}"
    "{%- endif -%}"
    "{{- '<tool_call>\\n<function=' ~ fn.name ~ '>\\n' -}}"
    "{%- if fn.arguments is defined -%}{%- for key, value in fn.arguments.items() -%}"
    "{{- '<parameter=' ~ key ~ '>\\n' -}}"
    "{%- if value is string -%}{{- value -}}{%- else -%}{{- value | tojson -}}{%- endif -%}"
    "{{- '\\n</parameter>\\n' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '</function>\\n</tool_call>\\n' -}}"
    "{%- endmacro -%}"
    "{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}"
    "{%- if tools and not (messages and messages[0].role == 'system') -%}"
    "{{- '<|im_start|>system\\n' ~ render_tools(tools) ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' -%}"
    "{{- '<|im_start|>system\\n' ~ render_content(message.content) -}}"
    "{%- if loop.first and tools -%}"
    "{%- if render_content(message.content) -%}{{- '\\n\\n' -}}{%- endif -%}{{- render_tools(tools) -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'user' -%}"
    "{{- '<|im_start|>user\\n' ~ render_content(message.content) ~ '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content is defined and message.reasoning_content -%}"
    "{{- '<think>\\n' ~ message.reasoning_content ~ '\\n</think>\\n' -}}"
    "{%- else -%}{{- '<think></think>' -}}{%- endif -%}"
    "{{- render_content(message.content) -}}"
    "{%- if message.tool_calls is defined and message.tool_calls -%}"
    "{%- if render_content(message.content) -%}{{- '\\n' -}}{%- endif -%}"
    "{%- for call in message.tool_calls -%}{{- render_tool_call(call) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' ~ render_content(message.content)"
    " ~ '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown message role: ' ~ message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if enable_thinking -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n<think></think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


# ---- synthetic tokenizer corpus -----------------------------------------------------------------
_NAMES = "alice bob carol dave erin frank grace heidi ivan judy mallory oscar peggy trent victor wendy".split()
_NOUNS = (
    "cat dog house river mountain city number answer question model token cache state layer "
    "expert engine request server table file list value result weather robot garden window"
).split()
_VERBS = "sees finds builds reads writes checks moves counts sends keeps opens closes likes helps".split()
_ADJS = "small large quick lazy bright dark happy careful simple strange green blue old new".split()
_CITIES = "Paris London Tokyo Berlin Madrid Rome Oslo Lima Cairo Seoul".split()
_EXTRA_WORDS = "café naïve résumé über Zürich façade 東京 北京 数据 模型 😀 🚀 ✓".split()


def _sentence(rng: random.Random) -> str:
    name, noun, noun2 = rng.choice(_NAMES).title(), rng.choice(_NOUNS), rng.choice(_NOUNS)
    forms = (
        f"The {rng.choice(_ADJS)} {noun} {rng.choice(_VERBS)} the {noun2}.",
        f"{name} {rng.choice(_VERBS)} a {rng.choice(_ADJS)} {noun} in {rng.choice(_CITIES)}.",
        f"Why does the {noun} need a {rng.choice(_ADJS)} {noun2}?",
        f'{name} said: "I like the {noun}, and the {rng.choice(_EXTRA_WORDS)} too."',
    )
    return rng.choice(forms)


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b} = {value}"


def _json_snippet(rng: random.Random) -> str:
    record = {
        "name": rng.choice(_NAMES),
        "age": rng.randint(1, 99),
        "city": rng.choice(_CITIES),
        "tags": rng.sample(_ADJS, 2),
        "active": rng.random() < 0.5,
        "score": round(rng.random(), 2),
    }
    return json.dumps(record, indent=rng.choice([None, 2]))


def _python_snippet(rng: random.Random) -> str:
    fn, arg = rng.choice(_VERBS).rstrip("s"), rng.choice(_NOUNS)
    return (
        f"def {fn}_{arg}({arg}, count={rng.randint(1, 9)}):\n"
        f"    for i in range(count):\n        {arg} = {arg} + i\n"
        f"    if {arg} > {rng.randint(10, 99)}:\n        return None\n    return {arg}\n"
    )


def _chat_snippet(rng: random.Random) -> str:
    city, unit = rng.choice(_CITIES), rng.choice(["celsius", "fahrenheit"])
    question, answer = _arithmetic(rng).split(" = ")
    parts = [
        "user",
        f"What is the weather in {city}?",
        "assistant",
        f"Let me check the weather in {city} first.",
        f"<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
        f"<parameter=unit>\n{unit}\n</parameter>\n</function>",
        "tool",
        json.dumps({"city": city, "temperature": rng.randint(-10, 35), "unit": unit}),
        "user",
        f"{question} = ?",
        "assistant",
        f"{question} = {answer}",
    ]
    return "\n".join(parts)


def synthetic_corpus(rng: random.Random, num_docs: int = 3000) -> list[str]:
    """Deterministic training text for the tiny tokenizer: prose, arithmetic, JSON, Python, chat turns."""
    makers = (_sentence, _sentence, _arithmetic, _json_snippet, _python_snippet, _chat_snippet)
    return [rng.choice(makers)(rng) for _ in range(num_docs)]


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on our synthetic corpus; special tokens get ids 0..len(SPECIAL_TOKENS)-1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[AddedToken(content, special=special, normalized=False) for content, special in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(random.Random(_CORPUS_SEED)), trainer)
    # Training registers all of them as special; re-add with the intended flags.
    tokenizer.add_special_tokens([AddedToken(c, special=True, normalized=False) for c, s in SPECIAL_TOKENS if s])
    tokenizer.add_tokens([AddedToken(c, special=False, normalized=False) for c, s in SPECIAL_TOKENS if not s])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    """tokenizer_config.json contents in the layout of real HF checkpoints."""
    decoder = {}
    for content, special in SPECIAL_TOKENS:
        decoder[str(tokenizer.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def tiny_config(tokenizer: Tokenizer, **overrides: Any) -> dict[str, Any]:
    """config.json for the tiny model; `overrides` replace (or add) HF config keys."""
    vocab_size = -(-tokenizer.get_vocab_size(with_added_tokens=True) // 8) * 8
    config: dict[str, Any] = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "torch_dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "hybrid_override_pattern": "M*MEM-M*E",
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.token_to_id("<s>"),
        "eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "pad_token_id": tokenizer.token_to_id("<|pad|>"),
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "chunk_size": 16,
        "expand": 1,
        "use_conv_bias": True,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "time_step_limit": [0.0, 1e9],
        "mamba_ssm_cache_dtype": "float32",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
        "n_shared_experts": 1,
        "moe_latent_size": None,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "intermediate_size": 128,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "use_bias": False,
        "num_nextn_predict_layers": 0,
        "initializer_range": 0.1,
        "rescale_prenorm_residual": True,
        "residual_in_fp32": False,
        "hidden_dropout": 0.0,
        "use_cache": True,
        "num_logits_to_keep": 1,
    }
    if "layers_block_type" in overrides and "hybrid_override_pattern" not in overrides:
        del config["hybrid_override_pattern"]
    config.update(overrides)
    if "num_hidden_layers" not in overrides:
        config["num_hidden_layers"] = len(layer_letters(config))
    return config


def layer_letters(config: dict[str, Any]) -> str:
    """Layer types as M/*/E/- letters, from `layers_block_type` or `hybrid_override_pattern`."""
    letters = parse_layer_types(config)
    if not letters:
        raise ValueError("config needs a non-empty hybrid_override_pattern or layers_block_type")
    return "".join(letters)


def _normal(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _uniform(gen: torch.Generator, *shape: int, bound: float) -> torch.Tensor:
    return (torch.rand(*shape, generator=gen, dtype=torch.float32) * 2.0 - 1.0) * bound


def _mamba_weights(cfg: dict[str, Any], gen: torch.Generator, num_layers: int) -> dict[str, torch.Tensor]:
    """One Mamba-2 mixer, shapes as in the HF checkpoint."""
    h, heads, std = cfg["hidden_size"], cfg["mamba_num_heads"], cfg["initializer_range"]
    inner = heads * cfg["mamba_head_dim"]
    conv_dim = inner + 2 * cfg["n_groups"] * cfg["ssm_state_size"]
    kernel = cfg["conv_kernel"]
    lo, hi = math.log(cfg["time_step_min"]), math.log(cfg["time_step_max"])
    dt = torch.exp(torch.rand(heads, generator=gen) * (hi - lo) + lo).clamp(min=cfg["time_step_floor"])
    out = {
        "in_proj.weight": _normal(gen, inner + conv_dim + heads, h, std=std),
        "conv1d.weight": _uniform(gen, conv_dim, 1, kernel, bound=1.0 / math.sqrt(kernel)),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # inverse softplus
        "A_log": torch.log(torch.arange(1, heads + 1, dtype=torch.float32)),
        "D": torch.ones(heads),
        "norm.weight": torch.ones(inner),
        # PyTorch's Linear default (kaiming_uniform a=sqrt(5)) scaled by 1/sqrt(num_layers)
        "out_proj.weight": _uniform(gen, h, inner, bound=1.0 / math.sqrt(inner)) / math.sqrt(num_layers),
    }
    if cfg["use_conv_bias"]:
        out["conv1d.bias"] = _uniform(gen, conv_dim, bound=1.0 / math.sqrt(kernel))
    if cfg["use_bias"]:
        out["in_proj.bias"] = torch.zeros(inner + conv_dim + heads)
        out["out_proj.bias"] = torch.zeros(h)
    return out


def _attention_weights(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, d, std = cfg["hidden_size"], cfg["head_dim"], cfg["initializer_range"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "q_proj.weight": _normal(gen, q, h, std=std),
        "k_proj.weight": _normal(gen, kv, h, std=std),
        "v_proj.weight": _normal(gen, kv, h, std=std),
        "o_proj.weight": _normal(gen, h, q, std=std),
    }


def _mlp_weights(
    cfg: dict[str, Any], gen: torch.Generator, d_in: int, d_ff: int, prefix: str = ""
) -> dict[str, torch.Tensor]:
    std = cfg["initializer_range"]
    out = {
        f"{prefix}up_proj.weight": _normal(gen, d_ff, d_in, std=std),
        f"{prefix}down_proj.weight": _normal(gen, d_in, d_ff, std=std),
    }
    if cfg["mlp_bias"]:
        out[f"{prefix}up_proj.bias"] = torch.zeros(d_ff)
        out[f"{prefix}down_proj.bias"] = torch.zeros(d_in)
    return out


def _moe_weights(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, experts, std = cfg["hidden_size"], cfg["n_routed_experts"], cfg["initializer_range"]
    latent = cfg.get("moe_latent_size")
    d_in = latent if latent is not None else h
    out = {
        "gate.weight": _normal(gen, experts, h, std=std),
        "gate.e_score_correction_bias": _normal(gen, experts, std=0.1),
    }
    for j in range(experts):
        out.update(_mlp_weights(cfg, gen, d_in, cfg["moe_intermediate_size"], prefix=f"experts.{j}."))
    out.update(_mlp_weights(cfg, gen, h, cfg["moe_shared_expert_intermediate_size"], prefix="shared_experts."))
    if latent is not None:
        out.update(
            {
                "fc1_latent_proj.weight": _normal(gen, latent, h, std=std),
                "fc2_latent_proj.weight": _normal(gen, h, latent, std=std),
            }
        )
    return out


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, fp32, under the original NVIDIA names."""
    if cfg.get("num_nextn_predict_layers", 0):
        raise ValueError("num_nextn_predict_layers: the tiny model does not write MTP weights; use 0")
    gen = torch.Generator().manual_seed(seed)
    h, std, letters = cfg["hidden_size"], cfg["initializer_range"], layer_letters(cfg)
    weights = {"backbone.embeddings.weight": _normal(gen, cfg["vocab_size"], h, std=std)}
    for i, letter in enumerate(letters):
        prefix = f"backbone.layers.{i}."
        weights[prefix + "norm.weight"] = torch.ones(h)
        if letter == "M":
            mixer = _mamba_weights(cfg, gen, len(letters))
        elif letter == "*":
            mixer = _attention_weights(cfg, gen)
        elif letter == "E":
            mixer = _moe_weights(cfg, gen)
        else:
            mixer = _mlp_weights(cfg, gen, h, cfg["intermediate_size"])
        weights.update({prefix + "mixer." + name: t for name, t in mixer.items()})
    weights["backbone.norm_f.weight"] = torch.ones(h)
    weights["lm_head.weight"] = _normal(gen, cfg["vocab_size"], h, std=std)
    return {name: t.contiguous() for name, t in weights.items()}


def make_tiny_model(out_dir: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Write a complete tiny NemotronH checkpoint folder into `out_dir`; return its path."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_tokenizer()
    config = tiny_config(tokenizer, **overrides)
    weights = random_weights(config, seed)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }
    for name, payload in (
        ("tokenizer_config.json", tokenizer_config(tokenizer)),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, ensure_ascii=False)
            f.write("\n")
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _run_cli(args: argparse.Namespace) -> int:
    print(make_tiny_model(args.out, seed=args.seed))
    return 0


def add_cli(subparsers: Any) -> None:
    """Register `make-tiny-model OUT [--seed N]`."""
    p = subparsers.add_parser("make-tiny-model", help="write a tiny random NemotronH checkpoint folder")
    p.add_argument("out", metavar="OUT", help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (the tokenizer does not depend on it)")
    p.set_defaults(func=_run_cli)
