"""Requests, sampling parameters and outputs."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # per-request RNG seed
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # return the chosen token's logprob per generated token
    top_logprobs: int = 0  # also return this many most likely tokens per position
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"),
            (_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1 (disabled) or >= 1"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be non-negative token ids",
            ),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the client or the engine


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Mutable per-request state owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV and mamba state are in this request's pages/slot
    page_ids: list[int] = field(default_factory=list)  # KV pages covering [0, num_computed + scheduled)
    live_slot: int | None = None  # mamba slot holding the live state
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    cache_node: Any = None  # locked radix node (the hit's source), released on free
    branch_point: int = 0  # grid position where this request left a cached KV path (0: none)
    bypass_cache: bool = False  # neither read nor write the prefix cache (canary cold runs)
    capture_states: bool = False  # keep copies of the hit snapshot and the post-prefill state (audits)
    finish_reason: FinishReason | None = None
    text: str = ""  # detokenised output so far (stop strings removed)
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass(frozen=True)
class CapturedState:
    """A copy of one request's mamba state (all mamba layers) after `num_tokens` tokens."""

    num_tokens: int
    conv: Any  # torch.Tensor [L_mamba, conv_dim, K-1]
    ssm: Any  # torch.Tensor [L_mamba, H, P, N] fp32


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One request's progress after a step. The token and logprob lists are read from the request's
    append-only lists when accessed (making an output costs O(1), not O(tokens so far) per step): each
    property returns a new list of the first `num_output_tokens` entries."""

    request_id: str
    prompt_token_ids: list[int]
    text: str  # detokenised generated text so far
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # tokens generated when this output was made
    output_token_ids: list[int] = field(repr=False)  # the request's list (append-only)
    output_logprobs: list[float] | None = field(repr=False)  # the request's list, None if not asked
    output_top_logprobs: list[dict[int, float]] | None = field(repr=False)  # likewise

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids so far (cumulative)."""
        return self.output_token_ids[: self.num_output_tokens]

    @property
    def logprobs(self) -> list[float] | None:
        """Chosen token's logprob per generated token, if asked."""
        src = self.output_logprobs
        return None if src is None else src[: self.num_output_tokens]

    @property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        """Per generated token: token id -> logprob, if asked."""
        src = self.output_top_logprobs
        return None if src is None else src[: self.num_output_tokens]

    def tokens_since(
        self, start: int
    ) -> tuple[tuple[int, ...], tuple[float, ...] | None, tuple[dict[int, float], ...] | None]:
        """(token ids, logprobs, top logprobs) generated after the first `start` tokens, up to this output."""
        n = self.num_output_tokens
        lp, top = self.output_logprobs, self.output_top_logprobs
        return (
            tuple(self.output_token_ids[start:n]),
            None if lp is None else tuple(lp[start:n]),
            None if top is None else tuple(top[start:n]),
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
