"""The workloads of `serving_bench`: `ISL:OSL:PROMPTS:CONCURRENCY` specs, the cases built from them (HTTP bodies and
the same prompts as engine token ids), and the model folders the benchmark writes (the embedded tiny model or a
Nano-shaped 8-layer one)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from loadtests.workloads import random_token_prompts

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}
NANO_OVERRIDES = {  # Nemotron-3 Nano 30B-A3B shapes (tests/engine/fixtures/nano_30b_a3b_config.json), 8 layers
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEM*EMEM",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "chunk_size": 128,
    "expand": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "intermediate_size": 1856,
    "routed_scaling_factor": 2.5,
    "initializer_range": 0.02,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 8192,
    "time_step_limit": [0.0, 1e9],
}


@dataclass(frozen=True)
class Workload:
    isl: int  # prompt tokens
    osl: int  # output tokens (ignore_eos)
    num_prompts: int
    concurrency: int  # requests in flight at most

    @classmethod
    def parse(cls, text: str) -> Workload:
        parts = text.split(":")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--workload must be ISL:OSL:PROMPTS:CONCURRENCY (positive ints), got {text!r}")
        return cls(*map(int, parts))

    @property
    def label(self) -> str:
        return f"{self.isl}in/{self.osl}out x{self.num_prompts} c{self.concurrency}"


@dataclass(frozen=True)
class Case:
    """One workload on one endpoint, with its prompts (token ids as the engine sees them)."""

    workload: Workload
    endpoint: str  # "completions" | "chat"
    bodies: list[dict]  # HTTP request bodies (without model / stream fields)
    engine_prompts: list[list[int]]  # the same prompts as token ids (chat: template applied and encoded)


# ---------------------------------------------------------------- model folders
def write_model(kind: str, out_dir: str, nano_experts: int, device: str, load_format: str = "auto") -> str:
    """The embedded tiny model, or a Nano-shaped 8-layer model with random bf16 weights and the embedded
    tokenizer (with load_format "dummy": no weights file, the engines draw them); an existing folder is reused."""
    from service.testing import tiny  # noqa: PLC0415

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    partial = out_dir + ".partial"
    tiny.make_tiny_model(partial)  # tokenizer files (and the tiny model's weights)
    if kind == "nano":
        from safetensors.torch import save_file  # noqa: PLC0415

        config = tiny.tiny_config(
            tiny.train_tokenizer(),
            **{**NANO_OVERRIDES, "n_routed_experts": nano_experts, "num_experts_per_tok": min(6, nano_experts)},
        )
        weights_path = os.path.join(partial, "model.safetensors")
        if load_format == "dummy":
            os.remove(weights_path)
        else:
            save_file(nano_weights(config, device), weights_path, metadata={"format": "pt"})
        with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    os.replace(partial, out_dir)
    return out_dir


def nano_weights(config: dict, device: str, seed: int = 0) -> dict:
    """bf16 checkpoint tensors: `tiny.random_weights` of the same model with one routed expert (on the CPU), and
    the router and every routed expert drawn on `device` (normal(0, initializer_range); the correction bias
    normal(0, 0.1) as `tiny` draws it): the experts are ~95 % of the parameters."""
    import torch  # noqa: PLC0415

    from service.testing import tiny  # noqa: PLC0415

    one = tiny.random_weights({**config, "n_routed_experts": 1, "num_experts_per_tok": 1}, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    experts, std = config["n_routed_experts"], config["initializer_range"]

    def draw(shape: tuple[int, ...], scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(torch.bfloat16).cpu()

    out = {}
    for name, t in one.items():
        if name.endswith(".mixer.gate.weight") or name.endswith(".mixer.gate.e_score_correction_bias"):
            out[name] = draw((experts, *t.shape[1:]), 0.1 if name.endswith("bias") else std)
        elif ".mixer.experts.0." in name:
            for j in range(experts):
                out[name.replace(".experts.0.", f".experts.{j}.")] = draw(tuple(t.shape), std)
        else:
            out[name] = t.to(torch.bfloat16)
    return out


def make_cases(model_path: str, workloads: list[Workload], endpoints: list[str], seed: int) -> list[Case]:
    from service.engine.tokenizer import Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_model_path(model_path)
    lo = max(tok.special_token_ids | {0}) + 1  # plain vocabulary tokens only
    cases = []
    for w in workloads:
        prompts = random_token_prompts(w.num_prompts, w.isl, (lo, tok.vocab_size), seed=seed)
        base = {"max_tokens": w.osl, "temperature": 0.0, "ignore_eos": True}
        for ep in endpoints:
            if ep == "completions":
                cases.append(Case(w, ep, [{**base, "prompt": p} for p in prompts], prompts))
                continue
            texts = [tok.decode(p) for p in prompts]
            ids = [
                tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True))
                for t in texts
            ]
            cases.append(Case(w, ep, [{**base, "messages": [{"role": "user", "content": t}]} for t in texts], ids))
    return cases


def shorter_case(case: Case, max_tokens: int) -> Case:
    """The case with every request's max_tokens capped at `max_tokens` (a warm-up run)."""
    bodies = [{**b, "max_tokens": min(max_tokens, b["max_tokens"])} for b in case.bodies]
    return Case(case.workload, case.endpoint, bodies, case.engine_prompts)


def case_key(case: Case) -> str:
    """The case's name in the report and the JSON: endpoint and workload label."""
    return f"{case.endpoint} {case.workload.label}"


def warmup_count(case: Case, warmup_prompts: int) -> int:
    """Prompts of the untimed warm-up run before the case (`--warmup-prompts`; 0: the workload's concurrency)."""
    return warmup_prompts or case.workload.concurrency
