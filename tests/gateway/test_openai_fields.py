"""Every request field of OpenAI's chat and completions APIs, walked from the official client's own types: each
is declared (so honoured, or refused with a 400 naming it), never silently dropped as unknown."""
from __future__ import annotations

import logging

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from servelab.gateway.errors import OpenAIError
from servelab.gateway.openai.protocol import (ACCEPTED_CHAT_HINTS, REFUSED_CHAT_FIELDS, ChatCompletionRequest,
                                       CompletionRequest, parse_request)

CHAT_FIELDS = sorted(chat_create_params.CompletionCreateParamsBase.__annotations__)
COMPLETION_FIELDS = sorted(completion_create_params.CompletionCreateParamsBase.__annotations__)
MESSAGES = [{"role": "user", "content": "hi"}]
# A value each refused field cannot be honoured with, and the fields refused only for some values.
REFUSED_VALUES = {"audio": {"voice": "alloy", "format": "mp3"}, "functions": [{"name": "f"}],
                  "function_call": "auto", "moderation": {"model": "x"}, "prediction": {"type": "content", "content": "x"},
                  "verbosity": "low", "web_search_options": {}, "modalities": ["text", "audio"],
                  "service_tier": "flex", "store": True}


def declared(model) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize("field", CHAT_FIELDS)
def test_every_chat_field_is_declared(field):
    assert field in declared(ChatCompletionRequest)


@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_every_completions_field_is_declared(field):
    assert field in declared(CompletionRequest)


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_chat_fields_are_400s_naming_them(field):
    with pytest.raises(OpenAIError) as info:
        parse_request(ChatCompletionRequest, {"messages": MESSAGES, field: REFUSED_VALUES[field]})
    assert (info.value.status, info.value.param) == (400, field)


def test_the_field_lists_cover_the_client():
    assert set(REFUSED_CHAT_FIELDS) <= set(REFUSED_VALUES) and set(ACCEPTED_CHAT_HINTS) <= set(CHAT_FIELDS)


def test_hints_are_accepted():
    req = parse_request(ChatCompletionRequest, {"messages": MESSAGES, "metadata": {"k": "v"}, "store": False,
                                                "prompt_cache_key": "p", "safety_identifier": "s", "user": "u",
                                                "service_tier": "auto", "modalities": ["text"]})
    assert req.metadata == {"k": "v"}


def test_unknown_fields_are_logged_once():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("servelab.gateway.openai.protocol")
    logger.addHandler(handler)  # directly: the server's logging setup may stop propagation to pytest's capture
    disabled, logger.disabled = logger.disabled, False  # and another tool's dictConfig may have disabled it
    try:
        for _ in range(3):
            parse_request(ChatCompletionRequest, {"messages": MESSAGES, "surely_unknown_field": 1})
    finally:
        logger.removeHandler(handler)
        logger.disabled = disabled
    assert sum("surely_unknown_field" in r.getMessage() for r in records) == 1
