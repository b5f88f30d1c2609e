"""Batched sampling on the model's device: greedy, temperature, top-k, top-p, min-p, per-request seeds,
chosen-token logprobs and top logprobs (of the raw model distribution)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.engine.kernels.transfer import to_device_async
from service.engine.request import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[float] | None  # chosen token's logprob per row (None if nobody asked)
    top_logprobs: list[dict[int, float]] | None  # per row: token id -> logprob of the top-n tokens


@dataclass(frozen=True)
class DeviceSample:
    """One sampler call's results, still on the model's device (nothing waited for)."""

    token_ids: torch.Tensor  # [R] int64 sampled token per row
    logprobs: torch.Tensor | None  # [R] fp32 chosen token's logprob (None if nobody asked)
    top_values: torch.Tensor | None  # [R, k] fp32 top-k logprobs, k = the largest top_logprobs asked
    top_ids: torch.Tensor | None  # [R, k] int64 their token ids
    top_counts: tuple[int, ...]  # per row: how many of the k it asked for

    def to_host(self) -> HostSample:
        """Starts the copies to the host without waiting (into pinned memory, then an event, on CUDA)."""
        tensors = (self.token_ids, self.logprobs, self.top_values, self.top_ids)
        if self.token_ids.device.type != "cuda":
            return HostSample(self, tuple(None if t is None else t.clone() for t in tensors), None)
        host = tuple(
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        )
        event = torch.cuda.Event()
        event.record()
        return HostSample(self, host, event)


@dataclass(frozen=True)
class HostSample:
    """Device results on their way to host memory; `result()` waits for these copies only: work enqueued after
    them (the next step's forward) keeps running."""

    device: DeviceSample
    host: tuple  # DeviceSample's four tensors (or None) in host memory, maybe in flight
    event: torch.cuda.Event | None  # recorded after the copies (None: copies already done, CPU)

    def result(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        tokens, lp, top_v, top_i = self.host
        top = None
        if top_v is not None:
            top = [
                dict(zip(top_i[r, :n].tolist(), top_v[r, :n].tolist())) for r, n in enumerate(self.device.top_counts)
            ]
        return SamplerOutput(tokens.tolist(), None if lp is None else lp.tolist(), top)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> SamplerOutput:
        """logits [R, V] fp32; one SamplingParams and optional seeded generator per row. Waits for the result."""
        return self.sample(logits, params, generators).to_host().result()

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> DeviceSample:
        """Enqueues the sampling of logits [R, V] fp32 and returns device tensors: no host sync (parameters go to
        the device by non-blocking copies from pinned memory, every branch is decided from `params`)."""
        R, V = logits.shape
        want_lp = any(p.logprobs or p.top_logprobs for p in params)
        if all(p.temperature == 0 for p in params) and not want_lp:
            return DeviceSample(torch.argmax(logits, dim=-1), None, None, None, ())  # all greedy: one kernel
        temps = self._tensor([p.temperature for p in params], torch.float32)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        scaled = self._filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        noise = self._exponential_noise(R, V, generators)
        sampled = torch.argmax(probs / noise, dim=-1)  # exponential race == multinomial draw
        tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled)
        if not want_lp:
            return DeviceSample(tokens, None, None, None, ())
        logprobs_all = torch.log_softmax(logits, dim=-1)
        chosen = logprobs_all.gather(1, tokens[:, None])[:, 0]
        k = max(p.top_logprobs for p in params)
        if k == 0:
            return DeviceSample(tokens, chosen, None, None, ())
        vals, ids = logprobs_all.topk(k, dim=-1)
        return DeviceSample(tokens, chosen, vals, ids, tuple(p.top_logprobs for p in params))

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device_async(values, dtype, self.device)

    def _filter(self, scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        V = scaled.shape[1]
        if any(0 < p.top_k < V for p in params) or any(p.top_p < 1 for p in params):
            top_k = self._tensor([p.top_k if p.top_k > 0 else V for p in params], torch.int64)
            top_p = self._tensor([p.top_p for p in params], torch.float32)
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            ranks = torch.arange(V, device=self.device)[None, :]
            cut = ranks >= top_k[:, None]
            probs = sorted_logits.softmax(-1)
            cum_before = probs.cumsum(-1) - probs  # mass strictly before each token
            cut |= cum_before >= top_p[:, None]
            cut[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
        if any(p.min_p > 0 for p in params):
            min_p = self._tensor([p.min_p for p in params], torch.float32)
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
