"""Batched sampling on the model's device: greedy, temperature, top-k, top-p, min-p, per-request seeds,
chosen-token logprobs and top logprobs (of the raw model distribution)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.request import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]                          # one sampled token per row
    logprobs: list[float] | None                  # chosen token's logprob per row (None if nobody asked)
    top_logprobs: list[dict[int, float]] | None   # per row: token id -> logprob of the top-n tokens


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        """logits [R, V] fp32; one SamplingParams and optional seeded generator per row."""
        R, V = logits.shape
        if all(p.temperature == 0 and not (p.logprobs or p.top_logprobs) for p in params):
            return SamplerOutput(torch.argmax(logits, dim=-1).tolist(), None, None)   # all greedy: one kernel
        logprobs_all = torch.log_softmax(logits, dim=-1)
        temps = torch.tensor([p.temperature for p in params], device=self.device, dtype=torch.float32)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(R, V, generators)
        sampled = torch.argmax(probs / noise, dim=-1)   # exponential race == multinomial draw
        tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
        want_lp = any(p.logprobs or p.top_logprobs for p in params)
        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0].tolist() if want_lp else None
        top = None
        k = max((p.top_logprobs for p in params), default=0)
        if k > 0:
            vals, ids = logprobs_all.topk(k, dim=-1)
            top = [dict(zip(ids[r, :p.top_logprobs].tolist(), vals[r, :p.top_logprobs].tolist()))
                   for r, p in enumerate(params)]
        return SamplerOutput(tokens.tolist(), chosen, top)

    def _filter(self, scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        V = scaled.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=self.device)
        top_p = torch.tensor([p.top_p for p in params], device=self.device, dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], device=self.device, dtype=torch.float32)
        if bool((top_k < V).any()) or bool((top_p < 1).any()):
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(V, device=self.device)[None, :]
            cut = ranks >= top_k[:, None]
            probs = sorted_logits.softmax(-1)
            cum_before = probs.cumsum(-1) - probs          # mass strictly before each token
            cut |= cum_before >= top_p[:, None]
            cut[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
        if bool((min_p > 0).any()):
            probs = scaled.softmax(-1)
            thresh = probs.max(-1, keepdim=True).values * min_p[:, None]
            scaled = scaled.masked_fill(probs < thresh, float("-inf"))
        return scaled

    def _exponential_noise(self, R: int, V: int, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty(R, V, device=self.device).exponential_(generator=self.generator)
        for r, g in enumerate(generators):
            if g is not None:
                noise[r].exponential_(generator=g)
        return noise.clamp_min_(1e-10)
