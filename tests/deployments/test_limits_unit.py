"""Keys and limits without a server: key files and the environment, constant-time lookup by hash, token
buckets on a hand-driven clock, reservation settlement, per-request caps."""

from __future__ import annotations

import hashlib

import pytest

from service.deployments.auth import API_KEYS_ENV, OPEN_KEY_ID, ApiKeys, key_id
from service.deployments.limits import KeyLimiter, LimitArgs, RequestShape, cap_violation

KEY_A, KEY_B = "sk-test-aaaaaaaaaaaa", "sk-test-bbbbbbbbbbbb"


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_keys_from_file_and_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# team a\n{KEY_A}\n\n  {KEY_B}  \n")
    keys = ApiKeys.load(str(path), environ={API_KEYS_ENV: "sk-env-cccccccccc, sk-env-dddddddddd"})
    assert len(keys.digests) == 4 and keys.enabled
    assert keys.authenticate(f"Bearer {KEY_A}") == hashlib.sha256(KEY_A.encode()).hexdigest()[:12] == key_id(KEY_A)
    assert keys.authenticate(f"bearer {KEY_B}") == key_id(KEY_B)
    assert keys.authenticate("Bearer sk-env-dddddddddd") == key_id("sk-env-dddddddddd")
    for bad in (None, "", "Bearer", f"Basic {KEY_A}", f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}", KEY_A):
        assert keys.authenticate(bad) is None, bad
    assert all(KEY_A not in d.hex() for d in keys.digests), "only digests are kept"


def test_no_keys_means_open_and_bad_key_sources_fail_closed(tmp_path):
    assert ApiKeys.load(None, environ={}).authenticate(None) == OPEN_KEY_ID
    with pytest.raises(ValueError, match="does not exist"):
        ApiKeys.load(str(tmp_path / "missing"), environ={})
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no keys"):
        ApiKeys.load(str(tmp_path / "empty"), environ={})
    with pytest.raises(ValueError, match=API_KEYS_ENV):
        ApiKeys.load(None, environ={API_KEYS_ENV: "short"})


def test_request_rate_refills_and_names_retry_after():
    clock = Clock()
    limiter = KeyLimiter(LimitArgs(requests_per_minute=6), clock)
    for _ in range(6):
        assert limiter.start("a") is None
        limiter.finish("a")
    refusal = limiter.start("a")
    assert refusal.status == 429 and refusal.limit == "requests_per_minute" and refusal.retry_after_s == 10
    assert limiter.start("b") is None, "another key has its own bucket"
    clock.now_s += 10.0
    assert limiter.start("a") is None


def test_concurrency_slots_are_released_by_finish():
    limiter = KeyLimiter(LimitArgs(concurrent_requests=2), Clock())
    assert limiter.start("a") is None and limiter.start("a") is None
    refusal = limiter.start("a")
    assert refusal.limit == "concurrent_requests" and refusal.retry_after_s == 1
    limiter.finish("a")
    assert limiter.start("a") is None and limiter.in_flight("a") == 2


def test_token_reservation_is_settled_with_the_real_count():
    clock = Clock()
    limiter = KeyLimiter(LimitArgs(tokens_per_minute=600), clock)
    assert limiter.reserve_tokens("a", 500) is None
    refusal = limiter.reserve_tokens("a", 200)
    assert refusal.status == 429 and refusal.limit == "tokens_per_minute" and refusal.retry_after_s == 10
    limiter.settle_tokens("a", reserved=500, used=120)  # 380 come back
    assert limiter.reserve_tokens("a", 480) is None
    limiter.settle_tokens("a", reserved=480, used=580)  # overdraw by 100: 0 - 100 left
    assert limiter.reserve_tokens("a", 1).retry_after_s == 11
    never = limiter.reserve_tokens("a", 601)
    assert never.status == 400 and "tokens_per_minute=600" in never.message


@pytest.mark.parametrize(
    "shape_kw,param,limit",
    [
        ({"max_tokens": 65}, "max_tokens", "max_tokens"),
        ({"n": 3, "num_choices": 3}, "n", "max_n"),
        ({"num_stop_strings": 5}, "stop", "max_stop_strings"),
        ({"top_logprobs": 4}, "top_logprobs", "max_top_logprobs"),
        ({"prompt_tokens": (10, 101)}, "prompt", "max_prompt_tokens"),
    ],
)
def test_per_request_caps_name_the_limit(shape_kw, param, limit):
    limits = LimitArgs(max_tokens=64, max_n=2, max_stop_strings=4, max_top_logprobs=3, max_prompt_tokens=100)
    base = dict(max_tokens=64, n=2, num_stop_strings=4, top_logprobs=3, prompt_tokens=(100,), num_choices=2)
    assert cap_violation(limits, RequestShape(**base)) is None
    got_param, got_limit, message = cap_violation(limits, RequestShape(**{**base, **shape_kw}))
    assert (got_param, got_limit) == (param, limit) and f"{limit}=" in message
    assert RequestShape(**base).reserved_tokens == 100 + 64 * 2


def test_serve_flags_reach_the_app_args(tmp_path):
    from service.cli import build_parser
    from service.deployments.args import AppArgs
    from service.deployments.serve_cli import app_args_from_cli

    ns = build_parser().parse_args(
        [
            "serve",
            "--model-path",
            str(tmp_path),
            "--api-keys-file",
            "/run/keys",
            "--limit-requests-per-minute",
            "60",
            "--limit-max-n",
            "2",
            "--limit-max-stop-strings",
            "4",
        ]
    )
    args = AppArgs.model_validate(app_args_from_cli(ns))
    assert args.api_keys_file == "/run/keys"
    assert args.limits == LimitArgs(requests_per_minute=60, max_n=2, max_stop_strings=4)
    default = AppArgs.model_validate(app_args_from_cli(build_parser().parse_args(["serve", "--model-path", "m"])))
    assert default.api_keys_file is None and default.limits == LimitArgs()
