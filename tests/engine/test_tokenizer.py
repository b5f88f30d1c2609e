"""Tokenizer layer against the tiny model's tokenizer, with transformers' tokenizer as the oracle."""

from __future__ import annotations

import json

import pytest
import transformers

from service.engine.tokenizer import IncrementalDetokenizer, Tokenizer, as_token_ids
from service.testing.tiny import SPECIAL_TOKENS, make_tiny_model

TEXTS = [
    "Hello, world! 12 + 35 = 47",
    "  leading spaces and\ttabs\nnew lines\r\n",
    "café naïve résumé Zürich — “quotes” ½",
    "東京は日本の首都です。数据模型",
    "emoji 😀🚀👩‍👩‍👧 flags 🇫🇷 and ✓",
    '{"name": "alice", "tags": ["a", "b"]}',
    "def f(x):\n    return x ** 2\n",
    "",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. "
    "The available functions, as JSON schemas:\n\n<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>\n\n"
    "To call a function, reply in exactly this format:\n<tool_call>\n<function=NAME>\n"
    "<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_model_path(model_dir)


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    with_bos = tok.encode(text, add_special_tokens=True)
    assert with_bos == [tok.token_to_id("<s>")] + ids == hf_tok.encode(text)
    assert tok.decode(ids) == hf_tok.decode(ids)


def test_special_tokens_are_single_ids(tok, hf_tok):
    for content, special in SPECIAL_TOKENS:
        token_id = tok.token_to_id(content)
        assert tok.encode(content) == [token_id]
        assert tok.encode(f"a{content}b")[1:-1] == [token_id]
        assert (token_id in tok.special_token_ids) == special
    hf_special = {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert tok.special_token_ids == hf_special >= set(hf_tok.all_special_ids)
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    assert tok.vocab_size == len(hf_tok) == 1000
    assert tok.token_to_id("<no such token>") is None


def test_skip_special_tokens_keeps_reasoning_markers(tok, hf_tok):
    text = "<|im_start|>assistant\n<think>\nhm</think>ok<tool_call>x</tool_call><|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm</think>ok<tool_call>x</tool_call>"
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)


def test_validate_token_ids(tok):
    tok.validate_token_ids([0, 5, tok.vocab_size - 1])
    with pytest.raises(ValueError, match=r"prompt: token id 1000 at position 2"):
        tok.validate_token_ids([1, 2, 1000, -1])
    with pytest.raises(ValueError, match=r"prompt: token id -1 at position 0"):
        tok.validate_token_ids([-1])
    with pytest.raises(ValueError, match="prompt: token at position 1"):
        tok.validate_token_ids([1, "x"])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenizer_one_token_at_a_time(tok, text, skip):
    ids = tok.encode("<|im_start|>" + text + "<|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.finish() == ""


def test_incremental_detokenizer_holds_partial_characters(tok):
    ids = tok.encode("🦄")
    assert len(ids) >= 3  # a 4-byte character the BPE never saw splits into byte-level pieces
    detok = tok.detokenizer()
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🦄"]
    # batches of several tokens at a time give the same text
    text = "héllo 東京 😀 done"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    assert "".join(detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) == text


def test_incremental_detokenizer_flushes_truncated_character(tok):
    ids = tok.encode("ok 🦄")[:-1]  # the stream stops inside the emoji
    detok = tok.detokenizer()
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.finish() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_incremental_detokenizer_decodes_a_bounded_window(tok, monkeypatch):
    """Per call the detokenizer decodes only the last emitted chunk plus the new ids."""
    ids = tok.encode(" ".join(["the quick brown fox"] * 50))
    lengths: list[int] = []
    real_decode = Tokenizer.decode
    monkeypatch.setattr(
        Tokenizer,
        "decode",
        lambda self, t, skip_special_tokens=False: lengths.append(len(t)) or real_decode(self, t, skip_special_tokens),
    )
    detok = tok.detokenizer()
    for i in ids:
        detok.add([i])
    assert len(ids) > 150 and max(lengths) <= 2


def _chat(tok, hf_tok, messages, **kwargs):
    ours = tok.apply_chat_template(messages, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **kwargs})
    assert ours == theirs
    return ours


def test_chat_template_thinking_on_and_off(tok, hf_tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ☃"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi ☃<|im_end|>\n"
    assert _chat(tok, hf_tok, messages) == head + "<|im_start|>assistant\n<think>\n"
    assert _chat(tok, hf_tok, messages, enable_thinking=True) == head + "<|im_start|>assistant\n<think>\n"
    assert _chat(tok, hf_tok, messages, enable_thinking=False) == head + "<|im_start|>assistant\n<think></think>"
    assert _chat(tok, hf_tok, messages, add_generation_prompt=False) == head


def test_chat_template_history_with_reasoning_and_content_parts(tok, hf_tok):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "two plus two"},
        {"role": "user", "content": "and 3+3?", "name": None},
        {"role": "assistant", "content": "6", "reasoning": "three plus three"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ]
    assert _chat(tok, hf_tok, messages, add_generation_prompt=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ntwo plus two\n</think>\n4<|im_end|>\n"
        "<|im_start|>user\nand 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthree plus three\n</think>\n6<|im_end|>\n"
        "<|im_start|>user\nthanks<|im_end|>\n"
        "<|im_start|>assistant\n<think></think>You're welcome.<|im_end|>\n"
    )


def test_chat_template_tools_and_tool_calls(tok, hf_tok):
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "call the tool",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'},
    ]
    expected = (
        "<|im_start|>system\nYou help.\n\n" + TOOLS_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ncall the tool\n</think>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n"
        '<|im_start|>tool\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\n"
    )
    assert _chat(tok, hf_tok, messages, tools=[WEATHER_TOOL]) == expected
    # no system message: the tools get a system turn of their own
    no_system = _chat(tok, hf_tok, messages[1:2], tools=[WEATHER_TOOL], enable_thinking=False)
    assert no_system == (
        "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think></think>"
    )


def test_chat_template_errors_name_the_problem(tok):
    with pytest.raises(ValueError, match="unknown message role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    bad_call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}
    with pytest.raises(ValueError, match="arguments must be a JSON object"):
        tok.apply_chat_template([bad_call])
    with pytest.raises(ValueError, match="messages\\[0\\] must be an object"):
        tok.apply_chat_template(["hi"])


def test_chat_prompt_tokens_match_transformers(tok, hf_tok):
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    prompt = tok.apply_chat_template(messages)
    hf_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.encode(prompt) == list(hf_ids)
    assert tok.encode(prompt)[-2:] == [tok.token_to_id("<think>"), tok.encode("\n")[0]]


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_model_path(tmp_path)


@pytest.mark.parametrize("batch", [2, 3, 7])
def test_add_many_gives_the_text_of_one_add_per_id(tok, batch):
    """Batches that end inside a character (the unicorn's byte pieces) emit what per-id calls emit: a stream cut
    there (ids[:k]) has the same text either way."""
    ids = tok.encode("ok 🦄 héllo 東京 🦄🦄 done <|im_end|>")
    for k in range(1, len(ids) + 1):
        one, many = tok.detokenizer(), tok.detokenizer()
        want = "".join(one.add([i]) for i in ids[:k])
        got = "".join(many.add_many(ids[i : min(i + batch, k)]) for i in range(0, k, batch))
        assert got == want, (k, got, want)


def test_as_token_ids_converts_integers_and_refuses_the_rest():
    assert as_token_ids((3, 0, 7)) == [3, 0, 7]
    assert all(type(t) is int for t in as_token_ids(range(5)))
    for bad in ([1, 2.0], [1, "2"], [1, None], [2**70]):
        with pytest.raises(ValueError, match="must be integers"):
            as_token_ids(bad)
