"""The OpenAI endpoint through the real `openai` client, against real Ray Serve on 127.0.0.1.

Token counts are checked against `transformers`' tokenizer loaded from the same model folder."""

from __future__ import annotations

import pytest
import transformers

LONG_TEXT = " ".join(f"The cat number {i} sees the dog near the river and counts {i * 7} stones." for i in range(40))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_path):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_path)


def _chat_prompt_len(hf_tokenizer, messages, **template_kwargs) -> int:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])


def test_models_lists_the_served_model(client, main_app):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 4096


def test_chat_non_streaming_usage_matches_tokenizer(client, hf_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a city."}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == _chat_prompt_len(hf_tokenizer, messages)
    assert resp.usage.completion_tokens == len(choice.logprobs.content)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 12
    # thinking is on by default: the generation prompt ends inside <think>, so text before </think> is reasoning
    reasoning = choice.message.model_extra.get("reasoning_content")
    assert reasoning or choice.message.content


def test_chat_streaming_equals_non_streaming(client, hf_tokenizer):
    messages = [{"role": "user", "content": "Tell me about the weather in the garden."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert reasoning == (full.choices[0].message.model_extra.get("reasoning_content") or "")
    assert content == (full.choices[0].message.content or "")
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == _chat_prompt_len(hf_tokenizer, messages)
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_enable_thinking_false_gives_plain_content(client, hf_tokenizer):
    messages = [{"role": "user", "content": "Say something."}]
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert resp.usage.prompt_tokens == _chat_prompt_len(hf_tokenizer, messages, enable_thinking=False)
    message = resp.choices[0].message
    assert message.model_extra.get("reasoning_content") is None and message.content


def test_completion_logprobs_are_consistent(client, hf_tokenizer):
    prompt = "The robot opens the window and"
    resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert resp.usage.prompt_tokens == len(hf_tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_n_two_choices_and_seeded_repeat(client):
    kwargs = dict(model="tiny", prompt="A list of numbers:", max_tokens=8, temperature=1.0, n=2, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeds make it reproducible
    assert first.usage.completion_tokens == 16


def test_stop_string_truncates_and_reports_stop(client):
    base = client.completions.create(
        model="tiny", prompt="The question is", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = next(
        (text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip() and "\ufffd" not in text[: i + 3]),
        None,
    )
    assert stop is not None, f"generated text too short for a stop string: {text!r}"
    cut = client.completions.create(
        model="tiny",
        prompt="The question is",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_repeated_long_prompt_reports_cached_tokens(client, hf_tokenizer):
    # The engine resumes from a snapshot strictly inside the prompt; keep the prompt off the 16-token grid
    # (an exactly grid-aligned repeat currently gets no hit: reported to the engine owner).
    question = next(
        q
        for q in ("Summarise.", "Summarise it.", "Summarise it all.", "Please summarise it all.")
        if _chat_prompt_len(hf_tokenizer, [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": q}])
        % 16
        != 0
    )
    messages = [{"role": "system", "content": LONG_TEXT}, {"role": "user", "content": question}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 256
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
