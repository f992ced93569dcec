"""/v1/completions and /v1/chat/completions: validate the request, process its prompts (tokenize and
check them against the engine's limits), admit, start its Job and answer in OpenAI's response or stream
format."""
from __future__ import annotations

import json
from typing import Callable

import jinja2
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from servelab.gateway.admission import AdmissionControl
from servelab.gateway.openai.chat_tools import hermes_messages, template_reads_tools
from servelab.gateway.openai.grammar_check import GrammarChecker
from servelab.engine.async_llm import AsyncLLM
from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import (OpenAIError, RequestBodyTooLarge, bad_request, client_closed,
                                     model_not_found, request_too_large, unsupported_media_type)
from servelab.gateway.job import CLIENT_CLOSED, ClientDisconnected, Job, RequestContext
from servelab.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from servelab.gateway.responses import ResponseBuilder
from servelab.gateway.sse import SSEResponse
from servelab.gateway.tokenize import detokenize, tokenize
from servelab.core.engine_io import EngineCoreRequest
from servelab.engine.input_processor import ContextLengthExceeded, PromptType
from servelab.sampling_params import SamplingParams
from servelab.structured_output import ll_tokenizer


def _is_json(content_type: str) -> bool:
    """application/json or application/*+json, any parameters (charset) after ';'."""
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, admission: AdmissionControl, config: ServerConfig) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self.tokenizer = engine.input_processor.tokenizer
        self.admission = admission
        self.config = config
        self.responses = ResponseBuilder(self.tokenizer, reasoning=config.reasoning_parser)
        processor = self.input_processor
        self.grammars = GrammarChecker(lambda: ll_tokenizer(self.tokenizer.to_json(), processor.limits.vocab_size,
                                                            processor.eos_token_ids))

    # ---- endpoints
    async def create_completion(self, http: Request) -> Response:
        ctx = RequestContext(http, "/v1/completions", "cmpl", self.config.request_timeout)
        try:
            req: CompletionRequest = parse_request(CompletionRequest, await self._read_json(http))
            req.check_limits(self.config)
            model = self._model(req.model)
            params = req.sampling_params()
            self._check_logit_bias(params)
            await self.grammars.check(req.grammar_sources())
            explicit = req.max_tokens if "max_tokens" in req.model_fields_set else None
            requests = self._process(ctx, self._completion_prompts(req.prompt), params, explicit, "prompt")
            job = await self._start(ctx, model, requests, params, bool(req.stream))
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
            req.check_limits(self.config)
            model = self._model(req.model)
            params = req.sampling_params()
            self._check_logit_bias(params)
            tool_grammar = req.tool_grammar()
            await self.grammars.check(req.grammar_sources() + req.function_schemas()
                                 + ([tool_grammar] if tool_grammar and req.tool_mode == "required" else []))
            requests = self._process(ctx, [self._chat_prompt(req)], params, req.requested_max_tokens, "messages")
            job = await self._start(ctx, model, requests, params, bool(req.stream))
        except OpenAIError as exc:
            ctx.log(exc.status, error=exc.message)
            raise
        if req.stream:
            return SSEResponse(self.responses.chat_stream(job, req), on_close=lambda: job.close(completed=False))
        return await self._complete(job, lambda: self.responses.chat_body(job, req))

    async def tokenize(self, http: Request) -> Response:
        body = await self._read_json(http)
        return JSONResponse(tokenize(self.tokenizer, body, self.input_processor.limits.max_model_len))

    async def detokenize(self, http: Request) -> Response:
        body = await self._read_json(http)
        return JSONResponse(detokenize(self.tokenizer, body, self.input_processor.limits.vocab_size))

    # ---- request handling
    async def _read_json(self, http: Request):
        content_type = http.headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            raise unsupported_media_type(content_type)
        try:
            raw = await http.body()
        except RequestBodyTooLarge as exc:
            raise request_too_large(self.config.max_request_bytes) from exc
        except ClientDisconnect as exc:
            raise client_closed() from exc
        if len(raw) > self.config.max_request_bytes:
            raise request_too_large(self.config.max_request_bytes)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from exc
        except RecursionError as exc:  # JSON nested thousands deep
            raise bad_request("the request body is not valid JSON: nested too deeply") from exc

    def _model(self, requested: str | None) -> str:
        if requested is None:
            return self.config.model_name
        if requested not in self.config.served_model_names:
            raise model_not_found(requested)
        return requested

    @staticmethod
    def _completion_prompts(prompt) -> list[PromptType]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        return list(prompt)

    def _check_logit_bias(self, params: SamplingParams) -> None:
        vocab_size = self.input_processor.limits.vocab_size
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")

    def _chat_prompt(self, req: ChatCompletionRequest) -> PromptType:
        messages = req.template_messages()
        tools = None
        if req.tools and req.tool_choice != "none":
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if not template_reads_tools(self.tokenizer.chat_template):
            messages, tools = hermes_messages(messages, tools), None
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                      tools=tools, **req.template_kwargs())
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc
        return {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}

    def _process(self, ctx: RequestContext, prompts: list[PromptType], params: SamplingParams,
                 explicit_max_tokens: int | None, param: str) -> list[EngineCoreRequest]:
        """Tokenize and validate every prompt before any is admitted. max_tokens the client set is not
        clamped to the context: too many is a 400, as in OpenAI's API."""
        ids = ctx.engine_request_ids(len(prompts))
        try:
            return [self.input_processor.process_inputs(request_id, prompt, params, ctx.arrival,
                                                        clamp_max_tokens=explicit_max_tokens is None)
                    for request_id, prompt in zip(ids, prompts)]
        except ContextLengthExceeded as exc:
            raise bad_request(str(exc), param=param, code="context_length_exceeded") from exc
        except ValueError as exc:
            raise bad_request(str(exc), param=param) from exc

    async def _start(self, ctx: RequestContext, model: str, requests: list[EngineCoreRequest],
                     params: SamplingParams, stream: bool) -> Job:
        ticket = self.admission.admit([len(r.prompt_token_ids) * params.n for r in requests])
        job = Job(ctx, self.engine, ticket, model, requests, params, stream,
                  max_unsent_tokens=self.config.max_unsent_tokens if stream else None)
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
