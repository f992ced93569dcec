"""A fake OpenAI-compatible streaming server that emits chunks on a schedule the test sets, and records
when it sent each one (time.perf_counter: it runs on a thread of the test process, same clock)."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from typing import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass(frozen=True)
class Plan:
    ttft_s: float = 0.05  # before the first content chunk
    itl_s: float = 0.02  # between content chunks
    num_chunks: int | None = None  # default: the request's max_tokens
    tokens_per_chunk: int = 1  # what `usage` reports per content chunk
    send_usage: bool = True
    empty_first_chunk: bool = True  # an empty-text chunk at once: must not count as the first token
    status: int = 200  # non-200: an OpenAI error body instead of a stream
    error_after: int | None = None  # an error event after this many content chunks


class FakeOpenAIServer:
    def __init__(self, plan: Callable[[dict], Plan] = lambda body: Plan()) -> None:
        self.plan = plan
        self.bodies: list[dict] = []
        self.emit_times: list[list[float]] = []  # per request (as bodies): when each content chunk was sent
        self.arrival_times: list[float] = []
        app = FastAPI()
        app.get("/v1/models")(self._models)
        app.post("/v1/completions")(self._generate)
        app.post("/v1/chat/completions")(self._generate)
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "FakeOpenAIServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def _generate(self, request: Request):
        body = await request.json()
        self.arrival_times.append(time.perf_counter())
        self.bodies.append(body)
        times: list[float] = []
        self.emit_times.append(times)
        plan = self.plan(body)
        if plan.status != 200:
            error = {"message": f"fake failure {plan.status}", "type": "fake", "param": None, "code": "fake"}
            return JSONResponse({"error": error}, status_code=plan.status)
        chat = "messages" in body
        num_chunks = plan.num_chunks if plan.num_chunks is not None else body["max_tokens"]

        def chunk(text: str | None, usage=None, role: bool = False) -> bytes:
            if text is None:
                choices = []
            elif chat:
                choices = [{"index": 0, "delta": {"role": "assistant", "content": text} if role else {"content": text}}]
            else:
                choices = [{"index": 0, "text": text}]
            return f"data: {json.dumps({'id': 'x', 'model': MODEL, 'choices': choices, 'usage': usage})}\n\n".encode()

        async def stream():
            if plan.empty_first_chunk or chat:
                yield chunk("", role=True)
            for i in range(num_chunks):
                if plan.error_after is not None and i == plan.error_after:
                    yield f"data: {json.dumps({'error': {'message': 'fake mid-stream failure'}})}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                await asyncio.sleep(plan.ttft_s if i == 0 else plan.itl_s)
                times.append(time.perf_counter())
                yield chunk(" ".join(["tok"] * plan.tokens_per_chunk) + " ")
            if plan.send_usage:
                yield chunk(None, usage={"prompt_tokens": 7, "completion_tokens": num_chunks * plan.tokens_per_chunk,
                                         "total_tokens": 7 + num_chunks * plan.tokens_per_chunk})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")
