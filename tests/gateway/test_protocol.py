"""Request validation: OpenAI's fields, strict types as 400s naming the field, unknown fields ignored."""
import pytest

from servelab.gateway.errors import OpenAIError
from servelab.gateway.openai.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                       parse_request)


def error_of(model, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse_request(model, body)
    assert info.value.status == 400
    return info.value


def test_completion_fields_map_to_sampling_params():
    req = parse_request(CompletionRequest, {
        "model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "n": 2, "stop": "x",
        "seed": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logprobs": 2, "user": "u",
        "top_k": 4, "min_p": 0.1, "ignore_eos": True, "repetition_penalty": 1.1, "unknown": [1, 2]})
    p = req.sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == (5, 0.0, 0.5, 2, ["x"], 3)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, -0.5, 2)
    assert (p.top_k, p.min_p, p.ignore_eos, p.repetition_penalty) == (4, 0.1, True, 1.1)


def test_defaults_follow_openai():
    p = parse_request(CompletionRequest, {"prompt": "hi"}).sampling_params()
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.logprobs) == (COMPLETIONS_DEFAULT_MAX_TOKENS, 1.0, 1.0, 1, None)
    chat = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.sampling_params().max_tokens is None  # as much as the context allows


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_forms(prompt):
    assert parse_request(CompletionRequest, {"prompt": prompt}).prompt == prompt


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "stop": 5}, "stop"),
])
def test_wrong_types_are_400_naming_the_field(body, param):
    assert error_of(CompletionRequest, body).param == param


@pytest.mark.parametrize("field, value", [("temperature", -1), ("n", 0), ("max_tokens", 0), ("logprobs", 50),
                                          ("top_p", 0.0), ("presence_penalty", 3.0)])
def test_out_of_range_values_name_the_field(field, value):
    req = parse_request(CompletionRequest, {"prompt": "x", field: value})
    with pytest.raises(OpenAIError) as info:
        req.sampling_params()
    assert (info.value.status, info.value.param) == (400, field)


def test_unsupported_and_inconsistent_fields():
    assert error_of(CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}).param == \
        "stream_options"
    assert error_of(CompletionRequest, {"prompt": "x", "best_of": 3}).param == "best_of"
    assert error_of(CompletionRequest, {"prompt": "x", "logit_bias": {"five": 1.0}}).param == "logit_bias"
    assert error_of(CompletionRequest, {"prompt": "x", "logit_bias": {"5": 101.0}}).param == "logit_bias"
    assert error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                            "top_logprobs": 2}).param == "top_logprobs"
    assert error_of(ChatCompletionRequest, {"messages": []}).param == "messages"
    assert parse_request(CompletionRequest, {"prompt": "x", "best_of": 1}).best_of == 1


def test_body_must_be_an_object():
    assert error_of(CompletionRequest, [1, 2]).param is None


def test_chat_messages():
    req = parse_request(ChatCompletionRequest, {
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None, "extra": 1}],
        "max_tokens": 9, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3})
    assert req.template_messages() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                       {"role": "assistant", "content": "", "extra": 1}]
    p = req.sampling_params()
    assert (p.max_tokens, p.logprobs) == (7, 3)  # max_completion_tokens wins; top_logprobs is the count
    assert parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                 "logprobs": True}).sampling_params().logprobs == 0
    assert error_of(ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}).param == \
        "messages[0].role"
    assert error_of(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}).param == \
        "messages[0].content"
    image = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(OpenAIError) as info:
        image.template_messages()
    assert info.value.param == "messages[0].content"


def test_include_usage_only_when_streaming():
    body = {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    assert parse_request(CompletionRequest, body).include_usage
    assert not parse_request(CompletionRequest, {"prompt": "x", "stream": True}).include_usage
