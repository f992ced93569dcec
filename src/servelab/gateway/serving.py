"""/v1/completions and /v1/chat/completions: validate the request, tokenize, admit, start its Job and
answer in OpenAI's response or stream format."""
from __future__ import annotations

import json
from typing import Callable

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from servelab.gateway.admission import AdmissionControl
from servelab.gateway.async_llm import AsyncLLM
from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import OpenAIError, RequestBodyTooLarge, bad_request, model_not_found, request_too_large
from servelab.gateway.job import CLIENT_CLOSED, ClientDisconnected, Job, Prompt, RequestContext
from servelab.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from servelab.gateway.responses import ResponseBuilder
from servelab.gateway.sse import SSEResponse
from servelab.engine.llm_engine import LLMEngine
from servelab.sampling_params import SamplingParams


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, llm_engine: LLMEngine, admission: AdmissionControl,
                 config: ServerConfig) -> None:
        self.engine = engine
        self.llm_engine = llm_engine
        self.tokenizer = llm_engine.tokenizer
        self.admission = admission
        self.config = config
        self.responses = ResponseBuilder(llm_engine.tokenizer)

    # ---- endpoints
    async def create_completion(self, http: Request) -> Response:
        ctx = RequestContext(http, "/v1/completions", "cmpl", self.config.request_timeout)
        try:
            req: CompletionRequest = parse_request(CompletionRequest, await self._read_json(http))
            model = self._model(req.model)
            params = req.sampling_params()
            prompts = self._completion_prompts(req.prompt)
            explicit = req.max_tokens if "max_tokens" in req.model_fields_set else None
            for p in prompts:
                self._check_length(p.token_ids, explicit, params, "prompt")
            job = await self._start(ctx, model, prompts, params, bool(req.stream))
        except OpenAIError as exc:
            ctx.log(exc.status, error=exc.message)
            raise
        if req.stream:
            return SSEResponse(self.responses.completion_stream(job, req), on_close=lambda: job.close(completed=False))
        return await self._complete(job, lambda: self.responses.completion_body(job, req))

    async def create_chat_completion(self, http: Request) -> Response:
        ctx = RequestContext(http, "/v1/chat/completions", "chatcmpl", self.config.request_timeout)
        try:
            req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await self._read_json(http))
            model = self._model(req.model)
            params = req.sampling_params()
            prompt = self._chat_prompt(req)
            self._check_length(prompt.token_ids, req.requested_max_tokens, params, "messages")
            job = await self._start(ctx, model, [prompt], params, bool(req.stream))
        except OpenAIError as exc:
            ctx.log(exc.status, error=exc.message)
            raise
        if req.stream:
            return SSEResponse(self.responses.chat_stream(job, req), on_close=lambda: job.close(completed=False))
        return await self._complete(job, lambda: self.responses.chat_body(job, req))

    # ---- request handling
    async def _read_json(self, http: Request):
        try:
            raw = await http.body()
        except RequestBodyTooLarge as exc:
            raise request_too_large(self.config.max_request_bytes) from exc
        if len(raw) > self.config.max_request_bytes:
            raise request_too_large(self.config.max_request_bytes)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from exc

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.config.model_name
        if requested not in self.config.served_model_names:
            raise model_not_found(requested)
        return requested

    def _completion_prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        prompts = []
        for item in items:
            text, token_ids = self.llm_engine.encode_prompt(item)
            prompts.append(Prompt(text, token_ids))
        return prompts

    def _chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        try:
            text = self.tokenizer.apply_chat_template(req.template_messages(),
                                                      add_generation_prompt=req.add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as exc:
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc
        return Prompt(None, self.tokenizer.encode(text, add_special_tokens=False))

    def _check_length(self, token_ids: list[int], max_tokens: int | None, params: SamplingParams, param: str) -> None:
        limit = self.llm_engine.max_model_len
        num = len(token_ids)
        if max_tokens is not None and num + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num + max_tokens} tokens ({num} in the prompt, {max_tokens} for max_tokens). "
                "Please reduce the length of the prompt or max_tokens.", param=param, code="context_length_exceeded")
        if num >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, the prompt is {num} tokens, "
                "leaving no room for max_tokens (at least 1). Please reduce the length of the prompt.",
                param=param, code="context_length_exceeded")
        try:
            self.llm_engine.validate(token_ids, params)
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from exc

    async def _start(self, ctx: RequestContext, model: str, prompts: list[Prompt], params: SamplingParams,
                     stream: bool) -> Job:
        ticket = self.admission.admit([len(p.token_ids) * params.n for p in prompts])
        job = Job(ctx, self.engine, ticket, model, prompts, params, stream)
        try:
            await job.start()
        except OpenAIError:
            job.close(log=False)  # the endpoint logs the error
            raise
        except BaseException:
            job.close(completed=False)
            raise
        return job

    async def _complete(self, job: Job, body: Callable[[], dict]) -> Response:
        completed = False
        try:
            async for _ in job.outputs(watch_disconnect=True):
                pass
            completed = True
        except OpenAIError as exc:
            job.fail(exc)
            completed = True
            raise
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            job.close(completed)
        return JSONResponse(body())
