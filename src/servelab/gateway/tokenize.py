"""/tokenize and /detokenize, as vLLM has them: a prompt (or chat messages, through the chat template) to
token ids with their count and the context limit, and token ids back to text."""
from __future__ import annotations

from typing import Any

import jinja2
from pydantic import BaseModel, ConfigDict

from servelab.gateway.errors import bad_request
from servelab.gateway.openai.protocol import ChatMessage, parse_request
from servelab.model.tokenizer import Tokenizer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


def tokenize(tokenizer: Tokenizer, body: Any, max_model_len: int) -> dict:
    req: TokenizeRequest = parse_request(TokenizeRequest, body)
    if req.messages is not None:
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 **(req.chat_template_kwargs or {}))
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc
        ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)
    body_out: dict = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if req.return_token_strs:
        body_out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return body_out


def detokenize(tokenizer: Tokenizer, body: Any, vocab_size: int) -> dict:
    req: DetokenizeRequest = parse_request(DetokenizeRequest, body)
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
