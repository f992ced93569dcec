"""The input processor (vLLM's process_inputs): tokenizes a prompt and validates it once, in the API
server's process, turning it into an EngineCoreRequest. It knows the engine only through EngineLimits."""
from __future__ import annotations

import time
from dataclasses import replace

from servelab.core.block_manager import cdiv
from servelab.core.engine_io import EngineCoreRequest, EngineLimits
from servelab.model.tokenizer import Tokenizer
from servelab.sampling_params import SamplingParams

PromptType = str | dict | list[int]


class ContextLengthExceeded(ValueError):
    """The prompt (with max_tokens, when that may not be clamped) does not fit the model's context."""


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, limits: EngineLimits, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_ids = eos_token_ids

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, clamp_max_tokens: bool = True) -> EngineCoreRequest:
        """Raises ValueError (ContextLengthExceeded for the context) for a request the engine cannot run.
        max_tokens beyond the context is clamped to what fits, or with clamp_max_tokens=False rejected
        (the OpenAI API's rule when the client set max_tokens)."""
        text, token_ids = self.tokenize(prompt)
        max_tokens = self._check(token_ids, params, clamp_max_tokens)
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        return EngineCoreRequest(request_id, text, token_ids, params, max_tokens, self.eos_token_ids, arrival)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, list):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, a token id list or a dict, not {type(prompt).__name__}")
        return prompt, self.tokenizer.encode(prompt)

    def _check(self, token_ids: list[int], params: SamplingParams, clamp_max_tokens: bool) -> int:
        """Returns the effective max_tokens."""
        limits = self.limits
        num = len(token_ids)
        if num == 0:
            raise ValueError("the prompt is empty")
        vocab = limits.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        limit = limits.max_model_len
        requested = params.max_tokens
        if not clamp_max_tokens and requested is not None and num + requested > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num + requested} tokens ({num} in the prompt, {requested} for max_tokens). "
                "Please reduce the length of the prompt or max_tokens.")
        if num >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, the prompt is {num} tokens, "
                "leaving no room for max_tokens (at least 1). Please reduce the length of the prompt.")
        room = limit - num
        max_tokens = room if requested is None else min(requested, room)
        # Each of the n samples must fit the whole cache on its own, or it would wait forever.
        if cdiv(num + max_tokens, limits.block_size) > limits.num_blocks:
            raise ValueError(
                f"the request needs {num + max_tokens} tokens of KV cache (prompt {num} + max_tokens {max_tokens}) "
                f"but the whole cache holds {limits.num_blocks * limits.block_size}; "
                "lower max_tokens or give the KV cache more memory")
        return max_tokens


def child_requests(request: EngineCoreRequest) -> list[EngineCoreRequest]:
    """The engine-core requests of a request with n samples: one sequence each, distinct seeds."""
    params = request.sampling_params
    if params.n == 1:
        return [request]
    return [replace(request, request_id=f"{i}_{request.request_id}", sampling_params=params.for_child(i))
            for i in range(params.n)]
