"""Per-key limits of the OpenAI ingress: rates (requests and tokens per minute), concurrent requests,
and per-request caps.

Rates are token buckets (capacity = the per-minute amount, refilled continuously at amount / 60 per
second). A generation request takes one request credit when it arrives and reserves `prompt tokens +
max_tokens` (summed over its choices) once its prompt is tokenized; when it ends the reservation is
settled with the real count (prompt + generated tokens) and the difference is given back. The state
lives in one ingress replica's memory: with several ingress replicas every replica enforces the
limits on its own share of the traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

MINUTE_S = 60.0


class LimitArgs(BaseModel):
    """Limits of the ingress (null: no limit). Rates and concurrency apply to each API key separately
    (to all callers together when no keys are configured); caps apply to every request."""

    model_config = ConfigDict(extra="forbid")
    requests_per_minute: int | None = Field(
        None, ge=1, description="per key: generation requests per minute (burst up to this many)"
    )
    tokens_per_minute: int | None = Field(
        None,
        ge=1,
        description="per key: tokens per minute; a request reserves prompt + max_tokens (all choices) "
        "and is settled with prompt + generated tokens when it ends",
    )
    concurrent_requests: int | None = Field(
        None, ge=1, description="per key: generation requests (streaming or not) in flight at once"
    )
    max_tokens: int | None = Field(
        None, ge=1, description="per request: largest max_tokens (also the default when a request sets none)"
    )
    max_n: int | None = Field(None, ge=1, description="per request: largest n (choices per prompt)")
    max_stop_strings: int | None = Field(16, ge=0, description="per request: most stop strings")
    max_top_logprobs: int | None = Field(
        None, ge=0, description="per request: largest top_logprobs (chat) or logprobs (completions)"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="per request: longest prompt in tokens")


@dataclass(frozen=True)
class RequestShape:
    """What one generation request asks for, as the per-request caps and the token reservation see it."""

    max_tokens: int  # largest max_tokens over its choices
    n: int  # choices per prompt
    num_stop_strings: int
    top_logprobs: int  # top alternatives asked per token (0: none)
    prompt_tokens: tuple[int, ...]  # token count of each prompt
    num_choices: int  # choices over all prompts

    @property
    def reserved_tokens(self) -> int:
        """Tokens reserved at admission: the prompts plus max_tokens for every choice (as `usage` counts them)."""
        return sum(self.prompt_tokens) + self.max_tokens * self.num_choices


def cap_violation(limits: LimitArgs, shape: RequestShape) -> tuple[str, str, str] | None:
    """(param, LimitArgs field, message) for the first per-request cap the request exceeds, else None."""
    checks = (
        ("max_tokens", "max_tokens", shape.max_tokens, limits.max_tokens),
        ("n", "max_n", shape.n, limits.max_n),
        ("stop", "max_stop_strings", shape.num_stop_strings, limits.max_stop_strings),
        ("top_logprobs", "max_top_logprobs", shape.top_logprobs, limits.max_top_logprobs),
        ("prompt", "max_prompt_tokens", max(shape.prompt_tokens, default=0), limits.max_prompt_tokens),
    )
    for param, limit, value, cap in checks:
        if cap is not None and value > cap:
            unit = " tokens" if param == "prompt" else ""
            return param, limit, f"'{param}' is {value}{unit}, over this server's limit {limit}={cap}{unit}."
    return None


@dataclass
class TokenBucket:
    """`capacity` credits, refilled at `capacity / 60` per second (monotonic seconds from `clock`)."""

    capacity: float
    clock: Callable[[], float]
    level: float = field(init=False)
    updated_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.level, self.updated_s = self.capacity, self.clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated_s) * self.capacity / MINUTE_S)
        self.updated_s = now

    def take(self, amount: float) -> float:
        """Takes `amount` and returns 0, or takes nothing and returns the seconds until it would fit."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        return (amount - self.level) * MINUTE_S / self.capacity

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)

    def charge(self, amount: float) -> None:
        """Takes `amount` even below zero (an overdraw the next requests wait for)."""
        self._refill()
        self.level -= amount


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: `status` 429 (retry after `retry_after_s`) or 400 (never fits)."""

    limit: str  # the LimitArgs field that refused it
    status: int
    message: str
    retry_after_s: int  # whole seconds, >= 1 for 429


@dataclass
class KeyState:
    """One key's live state in this ingress replica."""

    requests: TokenBucket | None
    tokens: TokenBucket | None
    in_flight: int = 0


class KeyLimiter:
    """Rate and concurrency limits per key id (a key's hash prefix, never the key)."""

    def __init__(self, limits: LimitArgs, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._keys: dict[str, KeyState] = {}

    def _state(self, key_id: str) -> KeyState:
        state = self._keys.get(key_id)
        if state is None:
            lim = self.limits
            state = self._keys[key_id] = KeyState(
                TokenBucket(lim.requests_per_minute, self._clock) if lim.requests_per_minute else None,
                TokenBucket(lim.tokens_per_minute, self._clock) if lim.tokens_per_minute else None,
            )
        return state

    def start(self, key_id: str) -> Refusal | None:
        """A generation request arrives: take a concurrency slot and a request credit, or refuse (429).
        After a None, `finish(key_id)` must follow exactly once."""
        state = self._state(key_id)
        cap = self.limits.concurrent_requests
        if cap is not None and state.in_flight >= cap:
            return Refusal(
                "concurrent_requests",
                429,
                f"Too many requests in flight for this API key (limit "
                f"concurrent_requests={cap}); retry when one finishes.",
                1,
            )
        if state.requests is not None:
            wait_s = state.requests.take(1)
            if wait_s > 0:
                return Refusal(
                    "requests_per_minute",
                    429,
                    f"Rate limit reached for this API key: limit "
                    f"requests_per_minute={self.limits.requests_per_minute}.",
                    _whole_s(wait_s),
                )
        state.in_flight += 1
        return None

    def reserve_tokens(self, key_id: str, tokens: int) -> Refusal | None:
        """Reserve `tokens` of the key's per-minute budget, or refuse (429; 400 when it can never fit)."""
        bucket = self._state(key_id).tokens
        if bucket is None:
            return None
        if tokens > bucket.capacity:
            return Refusal(
                "tokens_per_minute",
                400,
                f"The request needs {tokens} tokens (prompt + max_tokens for "
                f"every choice), more than this server's limit tokens_per_minute="
                f"{self.limits.tokens_per_minute}; lower max_tokens or n.",
                0,
            )
        wait_s = bucket.take(tokens)
        if wait_s > 0:
            return Refusal(
                "tokens_per_minute",
                429,
                f"Rate limit reached for this API key: limit tokens_per_minute="
                f"{self.limits.tokens_per_minute}, this request reserves {tokens}.",
                _whole_s(wait_s),
            )
        return None

    def settle_tokens(self, key_id: str, reserved: int, used: int) -> None:
        """A request that reserved `reserved` tokens ended having used `used`: give back (or take) the difference."""
        bucket = self._state(key_id).tokens
        if bucket is None or reserved == used:
            return
        if used < reserved:
            bucket.give_back(reserved - used)
        else:
            bucket.charge(used - reserved)

    def finish(self, key_id: str) -> None:
        state = self._state(key_id)
        state.in_flight = max(0, state.in_flight - 1)

    def in_flight(self, key_id: str) -> int:
        return self._state(key_id).in_flight


def _whole_s(seconds: float) -> int:
    return max(1, math.ceil(seconds))
