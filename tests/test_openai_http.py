"""The OpenAI-compatible body -> GenerateRequest conversion, on hand-made bodies (no service).

What the common clients send: the official SDK's typed messages (content parts), LangChain's
and the benchmark tools' payloads (stream_options, ignore_eos, max_completion_tokens, top_k);
and what the server refuses by name instead of ignoring (logprobs, penalties, tools, ...).
The service itself is exercised end to end in tests/test_service.py.
"""

from __future__ import annotations

import pytest

from services.openai_http import message_text, to_generate_request


def test_content_parts_become_the_messages_text():
    body = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                     {"type": "text", "text": "there"}]}]}
    req = to_generate_request(body, chat=True)
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "Be brief."), ("user", "Hello\nthere")]
    assert message_text([]) == ""


@pytest.mark.parametrize(("content", "error"), [
    ([{"type": "image_url", "image_url": {"url": "x"}}], "content part type 'image_url'"),
    ([{"type": "input_audio"}], "'input_audio' is not supported"),
    ([{"text": "no type"}], "string 'type'"),
    ([{"type": "text"}], "needs a string 'text'"),
    (5, "string or a list of content parts"),
    (None, "string or a list of content parts"),
])
def test_other_content_parts_are_refused_by_name(content, error):
    with pytest.raises(ValueError, match=error):
        to_generate_request({"messages": [{"role": "user", "content": content}]}, chat=True)


def test_the_benchmark_tools_payloads_convert():
    """vLLM's `benchmark_serving` / `vllm bench serve` chat and completions payloads."""
    chat = to_generate_request({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text",
                                                                  "text": "Hi"}]}],
        "temperature": 0.0, "max_completion_tokens": 128, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": -1,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1}, chat=True)
    assert chat.max_tokens == 128 and chat.temperature == 0.0 and chat.ignore_eos
    assert chat.top_k == 0  # vLLM's -1: off
    completion = to_generate_request({
        "model": "m", "prompt": "Once upon", "temperature": 0.0, "repetition_penalty": 1.0,
        "max_tokens": 64, "logprobs": None, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": False}, chat=False)
    assert completion.raw and completion.text == "Once upon" and not completion.ignore_eos
    assert completion.max_tokens == 64


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1.0), ("repetition_penalty", 1.1), ("logit_bias", {"5": 10}),
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("response_format", {"type": "json_object"}), ("parallel_tool_calls", True),
    ("min_tokens", 4), ("guided_json", {}), ("best_of", 2),
])
def test_fields_the_server_does_not_implement_are_refused_by_name(field, value):
    body = {"messages": [{"role": "user", "content": "Hi"}], field: value}
    with pytest.raises(ValueError, match=repr(field)):
        to_generate_request(body, chat=True)


def test_logprobs_fields_convert_per_endpoint():
    """Chat: logprobs true + top_logprobs k; completions: logprobs k; anything else is a
    clear error (the values themselves: tests/test_service.py against plain decoding)."""
    hi = [{"role": "user", "content": "Hi"}]

    def chat(**kw):
        return to_generate_request({"messages": hi, **kw}, chat=True)

    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(logprobs=True).logprobs == 0
    assert not chat(logprobs=False).HasField("logprobs")
    assert not chat(logprobs=False, top_logprobs=0).HasField("logprobs")
    completion = to_generate_request({"prompt": "Hi", "logprobs": 3}, chat=False)
    assert completion.logprobs == 3
    for body, message in (({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be"),
                          ({"logprobs": 3}, "logprobs must be a boolean")):
        with pytest.raises(ValueError, match=message):
            chat(**body)
    for value in (21, -1, "2", 1.5):
        with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
            to_generate_request({"prompt": "Hi", "logprobs": value}, chat=False)


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", False), ("presence_penalty", 0), ("frequency_penalty", 0.0),
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"),
    ("user", "alice"), ("logit_bias", {}), ("top_logprobs", None), ("service_tier", "auto"),
])
def test_fields_at_their_no_op_value_are_accepted(field, value):
    req = to_generate_request({"messages": [{"role": "user", "content": "Hi"}],
                               field: value}, chat=True)
    assert req.chat.messages[0].content == "Hi"


def test_a_chat_field_is_refused_on_completions():
    with pytest.raises(ValueError, match="'messages'"):
        to_generate_request({"prompt": "x", "messages": []}, chat=False)
    with pytest.raises(ValueError, match="'max_completion_tokens'"):
        to_generate_request({"prompt": "x", "max_completion_tokens": 4}, chat=False)


@pytest.mark.parametrize(("body", "error"), [
    ({"stream_options": {"include_usage": True}}, "needs stream: true"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "must be a boolean"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "only include_usage"),
    ({"ignore_eos": "true"}, "ignore_eos must be a boolean"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"max_tokens": True}, "max_tokens must be a number"),
    ({"n": 2}, "n must be 1"),
])
def test_malformed_options_are_refused(body, error):
    with pytest.raises(ValueError, match=error):
        to_generate_request({"messages": [{"role": "user", "content": "Hi"}], **body},
                            chat=True)


def test_return_token_ids_is_a_boolean_extension():
    """vLLM's return_token_ids: accepted on both endpoints (each choice then carries the
    generated ids, services/openai_http._sse); any other type is refused."""
    for chat, body in ((True, {"messages": [{"role": "user", "content": "Hi"}]}),
                       (False, {"prompt": "Hi"})):
        req = to_generate_request({**body, "return_token_ids": True, "stream": True}, chat)
        assert req.ignore_eos is False
        with pytest.raises(ValueError, match="return_token_ids must be a boolean"):
            to_generate_request({**body, "return_token_ids": "yes"}, chat)
