"""OpenAI's response bodies and stream chunks, built from a Job's RequestOutputs: its deltas for a stream,
their sum for a body."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from servelab.gateway.errors import OpenAIError
from servelab.gateway.job import Job
from servelab.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from servelab.gateway.sse import SSE_DONE, ChunkFrames, sse_event
from servelab.model.tokenizer import Tokenizer
from servelab.outputs import CompletionOutput, RequestOutput, TokenLogprob
from servelab.parsers import ChatDelta, ChatOutputParser


@dataclass
class _ChoiceState:
    """What one choice's stream has sent so far."""
    text_offset: int = 0
    started: bool = False
    finished: bool = False


class ResponseBuilder:
    def __init__(self, tokenizer: Tokenizer, reasoning: str | None = None) -> None:
        """reasoning: the --reasoning-parser splitting <think> text out of chat output, or None."""
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        self._token_strs: dict[int, str] = {}

    def _chat_parser(self, req: ChatCompletionRequest) -> ChatOutputParser | None:
        """A parser of one choice's text when tools or reasoning are in play; None for plain content."""
        mode = req.tool_mode
        if mode is None and self.reasoning is None:
            return None
        return ChatOutputParser(self.reasoning, mode, req.named_tool)

    def completion_body(self, job: Job, req: CompletionRequest) -> dict:
        choices = []
        for i, out in sorted(job.final.items()):
            for c in out.outputs:
                choices.append({"index": i * job.params.n + c.index,
                                "text": self._prompt_text(job, i) + c.text if req.echo else c.text,
                                "logprobs": self._completion_logprobs(c.logprobs or [], _ChoiceState())
                                if req.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": job.request_id, "object": "text_completion", "created": int(time.time()), "model": job.model,
                "choices": choices, "usage": job.usage()}

    def chat_body(self, job: Job, req: ChatCompletionRequest) -> dict:
        choices = []
        for c in job.final[0].outputs:
            parser = self._chat_parser(req)
            message = {"role": "assistant", "content": c.text}
            if parser is not None:
                parser.feed(c.text, final=True)
                message = parser.message()
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.logprobs or []) if req.logprobs else None,
                            "finish_reason": _chat_finish_reason(c.finish_reason, parser, req),
                            "stop_reason": c.stop_reason})
        return {"id": job.request_id, "object": "chat.completion", "created": int(time.time()), "model": job.model,
                "choices": choices, "usage": job.usage()}

    async def completion_stream(self, job: Job, req: CompletionRequest) -> AsyncIterator[bytes]:
        head = {"id": job.request_id, "object": "text_completion", "created": int(time.time()), "model": job.model}
        frames = ChunkFrames(head, {"usage": None} if req.include_usage else {})
        states = [_ChoiceState() for _ in range(len(job.requests) * job.params.n)]
        try:
            async for i, out in job.outputs():
                for index, c, state, text, logprobs in self._deltas(job, i, out, states):
                    if req.echo and not state.started:
                        text = self._prompt_text(job, i) + text
                    state.started = True
                    choice = {"index": index, "text": text,
                              "logprobs": self._completion_logprobs(logprobs, state) if req.logprobs is not None
                              else None, "finish_reason": _finish_reason(c), "stop_reason": c.stop_reason}
                    yield frames.frame(choice)
            async for frame in self._stream_end(job, req.include_usage, head):
                yield frame
        except OpenAIError as exc:
            async for frame in self._stream_error(job, exc):
                yield frame

    async def chat_stream(self, job: Job, req: ChatCompletionRequest) -> AsyncIterator[bytes]:
        head = {"id": job.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": job.model}
        frames = ChunkFrames(head, {"usage": None} if req.include_usage else {})
        states = [_ChoiceState() for _ in range(job.params.n)]
        parsers = [self._chat_parser(req) for _ in range(job.params.n)]
        try:
            for index in range(job.params.n):
                choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                yield frames.frame(choice)
            async for i, out in job.outputs():
                for index, c, state, text, logprobs in self._deltas(job, i, out, states):
                    parser = parsers[index]
                    if parser is None:
                        delta = {"content": text} if text or logprobs else {}
                    else:
                        delta = _delta_fields(parser.feed(text, final=c.finished))
                    finish = _finish_reason(c)
                    choice = {"index": index, "delta": delta,
                              "logprobs": self._chat_logprobs(logprobs) if req.logprobs else None,
                              "finish_reason": finish and _chat_finish_reason(finish, parser, req),
                              "stop_reason": c.stop_reason}
                    yield frames.frame(choice)
            async for frame in self._stream_end(job, req.include_usage, head):
                yield frame
        except OpenAIError as exc:
            async for frame in self._stream_error(job, exc):
                yield frame

    @staticmethod
    def _deltas(job: Job, prompt_index: int, out: RequestOutput,
                states: list[_ChoiceState]) -> Iterator[tuple[int, CompletionOutput, _ChoiceState, str, list]]:
        """(choice index, completion, its state, new text, new logprobs) for each choice with news."""
        for c in out.outputs:
            index = prompt_index * job.params.n + c.index
            state = states[index]
            if state.finished:
                continue
            logprobs = c.logprobs or []
            state.finished = c.finished
            if c.text or logprobs or c.finished:
                yield index, c, state, c.text, logprobs

    @staticmethod
    async def _stream_end(job: Job, include_usage: bool, head: dict) -> AsyncIterator[bytes]:
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": job.usage()})
        yield SSE_DONE
        job.close()

    @staticmethod
    async def _stream_error(job: Job, exc: OpenAIError) -> AsyncIterator[bytes]:
        job.fail(exc)
        job.close()
        yield sse_event(exc.body())
        yield SSE_DONE

    def _prompt_text(self, job: Job, prompt_index: int) -> str:
        request = job.requests[prompt_index]
        return request.prompt if request.prompt is not None else self.tokenizer.decode(request.prompt_token_ids)

    def _token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _completion_logprobs(self, entries: list[TokenLogprob], state: _ChoiceState) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            text = self._token_str(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            alternatives = {self._token_str(t): lp for t, lp in entry.top_logprobs}
            alternatives.setdefault(text, entry.logprob)
            top.append(alternatives)
            offsets.append(state.text_offset)
            state.text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text = self._token_str(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
                            for e in entries]}


def _finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason if c.finished else None


def _delta_fields(delta: ChatDelta) -> dict:
    fields: dict = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.tool_calls:
        fields["tool_calls"] = delta.tool_calls
    return fields


def _chat_finish_reason(finish_reason: str | None, parser: ChatOutputParser | None,
                        req: ChatCompletionRequest) -> str | None:
    """OpenAI's "tool_calls" when the model chose to call tools (auto or required; a named function's call
    was the request's, and ends as "stop")."""
    if finish_reason == "stop" and parser is not None and parser.tool_calls and req.tool_mode in ("auto", "required"):
        return "tool_calls"
    return finish_reason
