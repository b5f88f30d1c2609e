"""Frozen configuration dataclasses: the parsed HF NemotronH config (`ModelConfig`) and the engine's
settings (`EngineConfig`, the one place an engine setting is declared).

`ModelConfig.from_hf_dict` accepts both layer encodings (`hybrid_override_pattern` string and
`layers_block_type` list) and the legacy `mamba_*` aliases; inconsistent configs raise
`ValueError` naming the field to change.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from service.engine.settings import check_settings

# Layer-type letters used everywhere inside the engine.
MAMBA, ATTENTION, MOE, MLP = "M", "*", "E", "-"
_LIST_TO_LETTER = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "moe": MOE,
    "mlp": MLP,
}
_LEGACY_ALIASES = {  # legacy key -> canonical key
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_chunk_size": "chunk_size",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
}


def parse_layer_types(
    cfg: dict[str, Any], list_key: str = "layers_block_type", pattern_key: str = "hybrid_override_pattern"
) -> tuple[str, ...] | None:
    """Layer letters from the list encoding (`list_key`) or the pattern string (`pattern_key`).

    Returns None when neither key is present (or both are null); the caller decides on a default.
    """
    blocks = cfg.get(list_key)
    if blocks is None and list_key == "layers_block_type":
        blocks = cfg.get("layer_types")
    pattern = cfg.get(pattern_key)
    if blocks is not None:
        if isinstance(blocks, str) or not isinstance(blocks, (list, tuple)):
            raise ValueError(f"{list_key} must be a list of layer type names, got {blocks!r}")
        unknown = sorted({str(b) for b in blocks if b not in _LIST_TO_LETTER})
        if unknown:
            raise ValueError(f"{list_key} has unknown layer types {unknown}; use one of {sorted(_LIST_TO_LETTER)}")
        letters = tuple(_LIST_TO_LETTER[b] for b in blocks)
        if pattern is not None and "".join(letters) != pattern:
            raise ValueError(f"{pattern_key} and {list_key} disagree; give only one")
        return letters
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise ValueError(f"{pattern_key} must be a string of layer letters, got {pattern!r}")
    unknown = sorted({c for c in pattern if c not in (MAMBA, ATTENTION, MOE, MLP)})
    if unknown:
        raise ValueError(f"{pattern_key} has unknown layer letters {unknown}; use M, *, E or -")
    return tuple(pattern)


# transformers writes non-finite floats as {"__float__": "Infinity"} (configuration_utils).
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf}


def _finite_limit(value: Any) -> tuple[float, float]:
    """time_step_limit as (lo, hi); accepts plain numbers and transformers' tagged infinities."""
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"time_step_limit must be a pair [lo, hi], got {value!r}")

    def conv(x: Any) -> float:
        if isinstance(x, dict):
            tag = x.get("__float__") if set(x) == {"__float__"} else None
            if tag not in _FLOAT_TAGS:
                raise ValueError(f"time_step_limit has an unsupported value {x!r}")
            return _FLOAT_TAGS[tag]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
            raise ValueError(f"time_step_limit must hold numbers, got {x!r}")
        return float(x)

    lo, hi = conv(value[0]), conv(value[1])
    if not lo <= hi:
        raise ValueError(f"time_step_limit lower bound {lo} exceeds upper bound {hi}")
    return (lo, hi)


def _resolve_legacy_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """Copy of `raw` with legacy `mamba_*` keys moved to their canonical names.

    A legacy key that disagrees with its canonical key is an error (transformers would silently
    prefer the legacy one).
    """
    cfg = dict(raw)
    for legacy, canon in {"mamba_n_groups": "n_groups", **_LEGACY_ALIASES}.items():
        if legacy not in cfg:
            continue
        value = cfg.pop(legacy)
        if canon in cfg and cfg[canon] != value:
            raise ValueError(f"{legacy} ({value!r}) must equal {canon} ({cfg[canon]!r}); give only {canon}")
        cfg[canon] = value
    return cfg


@dataclass(frozen=True)
class ModelConfig:
    """NemotronH architecture; field names follow the HF config keys."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # one letter per layer: M, *, E, -
    layer_norm_epsilon: float
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # mamba-2
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj bias of the mamba mixer
    time_step_min: float
    time_step_limit: tuple[float, float]  # (lo, hi) clamp of dt after softplus
    # dense MLP and MoE
    intermediate_size: int
    mlp_bias: bool
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # misc
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    num_nextn_predict_layers: int
    mtp_layer_types: tuple[str, ...]
    torch_dtype: str
    mamba_ssm_cache_dtype: str = "float32"  # the SSM state dtype the checkpoint asks for

    # ---- derived ----
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:  # Di
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        return self.mamba_intermediate + self.conv_dim + self.mamba_num_heads

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == MAMBA)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def pattern(self) -> str:
        return "".join(self.layer_types)

    @property
    def dt_clamp(self) -> tuple[float, float]:
        """dt clamp as transformers applies it: lower bound time_step_min, upper from time_step_limit."""
        return (max(self.time_step_min, self.time_step_limit[0]), self.time_step_limit[1])

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an HF NemotronH config.json dict; defaults are those of transformers' NemotronHConfig."""
        cfg = _resolve_legacy_aliases(raw)
        if cfg.get("hidden_size") is None:
            raise ValueError("config needs hidden_size")
        layer_types = parse_layer_types(cfg)
        if layer_types is None:
            raise ValueError("config needs hybrid_override_pattern or layers_block_type")
        mtp_types = parse_layer_types(cfg, "mtp_layers_block_type", "mtp_hybrid_override_pattern")
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        n_heads = int(cfg.get("num_attention_heads", 32))
        n_kv = cfg.get("num_key_value_heads", 8)  # transformers: null means "same as query heads"
        head_dim = cfg.get("head_dim", 128)
        c = cls(
            vocab_size=int(cfg.get("vocab_size", 131072)),
            hidden_size=int(cfg["hidden_size"]),
            layer_types=layer_types,
            layer_norm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)),
            num_attention_heads=n_heads,
            num_key_value_heads=int(n_heads if n_kv is None else n_kv),
            head_dim=int(cfg["hidden_size"] // n_heads if head_dim is None else head_dim),
            mamba_num_heads=int(cfg.get("mamba_num_heads", 128)),
            mamba_head_dim=int(cfg.get("mamba_head_dim", 64)),
            n_groups=int(cfg.get("n_groups", 8)),
            ssm_state_size=int(cfg.get("ssm_state_size", 128)),
            conv_kernel=int(cfg.get("conv_kernel", 4)),
            chunk_size=int(cfg.get("chunk_size", 128)),
            use_conv_bias=bool(cfg.get("use_conv_bias", True)),
            use_bias=bool(cfg.get("use_bias", False)),
            time_step_min=float(cfg.get("time_step_min", 0.001)),
            time_step_limit=_finite_limit(cfg.get("time_step_limit")),
            intermediate_size=int(cfg.get("intermediate_size", 21504)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            n_routed_experts=int(cfg.get("n_routed_experts", 8)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 7688)),
            moe_shared_expert_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size", 7688)),
            moe_latent_size=(int(cfg["moe_latent_size"]) if cfg.get("moe_latent_size") else None),
            n_group=int(cfg.get("n_group", 1)),
            topk_group=int(cfg.get("topk_group", 1)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_id=eos_ids,
            bos_token_id=cfg.get("bos_token_id", 1),
            pad_token_id=cfg.get("pad_token_id", 0),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers", 0)),
            mtp_layer_types=mtp_types if mtp_types is not None else (ATTENTION, MOE),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            mamba_ssm_cache_dtype=str(cfg.get("mamba_ssm_cache_dtype") or "float32"),
        )
        c.validate()
        return c

    @classmethod
    def from_model_path(cls, model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"model_path {model_path!r} has no config.json")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.num_layers > 0, "the model needs at least one layer")
        if MAMBA in self.layer_types:
            need(
                self.mamba_num_heads % self.n_groups == 0,
                f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups ({self.n_groups})",
            )
            need(self.conv_kernel >= 2, f"conv_kernel ({self.conv_kernel}) must be >= 2")
            need(self.chunk_size >= 1, f"chunk_size ({self.chunk_size}) must be >= 1")
        if ATTENTION in self.layer_types:
            need(
                self.num_attention_heads % self.num_key_value_heads == 0,
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})",
            )
        if MOE in self.layer_types:
            need(
                1 <= self.num_experts_per_tok <= self.n_routed_experts,
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, n_routed_experts="
                f"{self.n_routed_experts}]",
            )
            need(
                self.n_routed_experts % self.n_group == 0,
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})",
            )
            need(
                1 <= self.topk_group <= self.n_group,
                f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]",
            )

    def num_parameters(self, include_mtp: bool = False) -> int:
        """Tensor elements in the checkpoint (parameters plus the MoE correction-bias buffers).

        MTP layers (Super) are left out unless asked; each MTP depth adds enorm, hnorm,
        eh_proj [h, 2h], its `mtp_layer_types` blocks (norm + mixer each) and a final norm.
        """
        h = self.hidden_size
        per_type = {
            MAMBA: self._mamba_params(),
            ATTENTION: self._attention_params(),
            MOE: self._moe_params(),
            MLP: self._relu2_mlp_params(self.intermediate_size),
        }
        # embeddings, lm_head, norm_f; NemotronH never ties lm_head (transformers ignores
        # tie_word_embeddings for it: _tied_weights_keys is empty), so both are always stored.
        total = 2 * self.vocab_size * h + h
        total += sum(per_type[t] + h for t in self.layer_types)  # + per-layer norm
        if include_mtp and self.num_nextn_predict_layers:
            per_depth = 2 * h + 2 * h * h + sum(per_type[t] + h for t in self.mtp_layer_types) + h
            total += self.num_nextn_predict_layers * per_depth
        return total

    def _relu2_mlp_params(self, width: int) -> int:
        h = self.hidden_size
        return 2 * h * width + ((width + h) if self.mlp_bias else 0)

    def _mamba_params(self) -> int:
        h, hm = self.hidden_size, self.mamba_num_heads
        bias = self.in_proj_dim + h if self.use_bias else 0
        conv = self.conv_dim * self.conv_kernel + (self.conv_dim if self.use_conv_bias else 0)
        # in_proj, conv1d, dt_bias/A_log/D, gated-norm weight, out_proj
        return h * self.in_proj_dim + conv + 3 * hm + self.mamba_intermediate + self.mamba_intermediate * h + bias

    def _attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)

    def _moe_params(self) -> int:
        h, e, latent = self.hidden_size, self.n_routed_experts, self.moe_latent_size
        experts = e * 2 * (latent or h) * self.moe_intermediate_size  # routed experts have no bias
        latent_proj = (2 * h * latent + ((latent + h) if self.mlp_bias else 0)) if latent else 0
        shared = self._relu2_mlp_params(self.moe_shared_expert_intermediate_size)
        return experts + latent_proj + shared + e * h + e  # + router weight and correction bias


KERNEL_BACKENDS = ("torch", "native", "triton")
CACHE_STRATEGIES = ("off", "no_buffer", "extra_buffer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16")
CUDA_WARMUP_STEPS = 256  # start-up warm-up steps on CUDA (EngineConfig.warmup_steps)


def setting(default: Any, help: str, **checks: Any) -> Any:  # noqa: A002  (the metadata key is "help")
    """A settings field: its default, one line of help and the checks of service/engine/settings.py."""
    return field(default=default, metadata={"help": help, **checks})


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, declared once: `Engine(EngineConfig(model_path=...))`.

    Each field's metadata (help, choices, min, pattern, aliases) feeds the `serve` and `generate`
    flags, the Serve app's arguments and the Helm chart's values schema (service/engine/settings.py).
    """

    model_path: str = field(metadata={"help": "folder with config.json, safetensors weights and tokenizer"})
    device: str = setting(
        "auto", "auto (cuda when a GPU is visible, else cpu), cpu, cuda or cuda:N", pattern=r"auto|cpu|cuda(:[0-9]+)?"
    )
    dtype: str = setting(
        "auto", "weight/activation dtype; auto: the checkpoint's on CUDA, float32 on CPU", choices=DTYPES
    )
    kernel_backend: str | None = setting(
        None,
        "kernels: torch, native (torch plus compiled C kernels for the CPU decode step; needs a C compiler) or "
        "triton; default: triton on CUDA, native on CPU",
        choices=KERNEL_BACKENDS,
    )
    page_size: int = setting(16, "tokens per KV-cache page", min=1)
    max_num_seqs: int = setting(64, "running requests at most", min=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one engine step", min=1)
    max_model_len: int | None = setting(
        None, "context length in tokens; default: the model's max_position_embeddings", min=1
    )
    mamba_cache_strategy: str = setting(
        "extra_buffer",
        "hybrid prefix cache: off, no_buffer (needs page_size 1) or extra_buffer",
        choices=CACHE_STRATEGIES,
        aliases=("--mamba-scheduler-strategy",),
    )
    num_kv_pages: int | None = setting(None, "KV pool size in pages; default: sized from max_num_seqs", min=1)
    num_mamba_slots: int | None = setting(None, "live Mamba state slots; default: max_num_seqs", min=1)
    max_mamba_snapshots: int | None = setting(
        None, "Mamba snapshot slots of the prefix cache; default: 2 x max_num_seqs", min=0
    )
    mamba_track_interval: int | None = setting(
        None, "tokens between decode-time snapshots (a multiple of the snapshot grid); default: none", min=1
    )
    seed: int = setting(0, "seed of the engine's sampler (a request's own seed takes precedence)")
    debug_integrity: bool = setting(False, "check the cache and pool invariants after every step (slow)")
    cuda_graphs: bool = setting(True, "replay captured decode-only steps (CUDA with triton kernels; ignored otherwise)")
    async_scheduling: bool = setting(True, "launch the next step before reading this one's tokens")
    warmup_steps: int | None = setting(
        None,
        "engine steps of random traffic run at start, before the first request, so the kernels of the step "
        "shapes that traffic makes are compiled and loaded then and not in a user's step; default: "
        f"{CUDA_WARMUP_STEPS} on CUDA, 0 on CPU (no kernel is compiled there)",
        min=0,
    )
    tp: int = setting(1, "tensor-parallel ranks, one GPU each: GPUs per engine replica", min=1)
    ep: int = setting(
        1,
        "1 (each expert split over the tp ranks) or tp (whole experts spread over the same tp ranks; no extra GPUs)",
        min=1,
    )
    load_format: str = setting(
        "auto",
        "where the weights come from: auto reads the checkpoint's safetensors; dummy "
        "draws random weights on the device from config.json alone (at the checkpoint's "
        "dtype and quantization, deterministic by seed), for benchmarks",
        choices=LOAD_FORMATS,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache element type: auto (fp8 when the checkpoint's kv_cache_quant_algo is FP8, else the model "
        "dtype), bf16, or fp8 (float8_e4m3fn pages scaled by the checkpoint's per-layer k_scale / v_scale, "
        "1.0 without them: twice the tokens per GiB of bf16)",
        choices=KV_CACHE_DTYPES,
    )
    mamba_ssm_cache_dtype: str = setting(
        "auto",
        "element type of the Mamba SSM states (live and snapshot slots): auto (the checkpoint's "
        "mamba_ssm_cache_dtype, float32 when it names none, as transformers reads it), float32, or bfloat16 (half the state memory and "
        "decode traffic; the recurrence runs in fp32 and the state is rounded where it is stored: after every "
        "decode token, at every chunk end of a prefill and at the end of each prefill step)",
        choices=SSM_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = setting(
        0.90,
        "fraction of the GPU's memory the engine may use: on CUDA the KV "
        "pages and Mamba slots fill what the weights and a profiling forward "
        "leave (within max_num_seqs); ignored on CPU",
        min=0.01,
    )

    def resolved(self) -> EngineConfig:
        """This config with device "auto" and an unset kernel_backend replaced by what this machine runs."""
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        cuda = device.startswith("cuda")
        backend = self.kernel_backend or ("triton" if cuda else "native")
        warmup = self.warmup_steps if self.warmup_steps is not None else (CUDA_WARMUP_STEPS if cuda else 0)
        return replace(self, device=device, kernel_backend=backend, warmup_steps=warmup)

    def validate(self) -> None:
        """ValueError naming the setting to change; the per-field checks come from the field declarations."""
        check_settings(self)
        if self.mamba_cache_strategy == "no_buffer" and self.page_size != 1:
            raise ValueError(
                f"mamba_cache_strategy='no_buffer' needs page_size=1 (got page_size={self.page_size}); "
                "use 'extra_buffer' for larger pages"
            )
        if self.mamba_cache_strategy != "off" and self.max_mamba_snapshots == 0:
            raise ValueError(
                f"max_mamba_snapshots must be >= 1 with mamba_cache_strategy="
                f"{self.mamba_cache_strategy!r} (got 0); use 'off' to disable caching"
            )
        if self.kernel_backend == "native" and self.device.startswith("cuda"):
            raise ValueError("kernel_backend='native' runs on the CPU; use device='cpu', or kernel_backend='triton'")
        if self.gpu_memory_utilization > 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.ep not in (1, self.tp):
            raise ValueError(
                f"ep must be 1 (experts split by tp) or equal to tp={self.tp} (whole experts spread "
                f"over the tp ranks), got ep={self.ep}"
            )
