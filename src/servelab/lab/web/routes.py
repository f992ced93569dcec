"""The lab page's routes, one APIRouter for `servelab serve` and `servelab lab web` alike:

  GET  /lab                 the page (static/index.html, lab.js, lab.css under /lab/static/)
  GET  /lab/api/catalog     GPU and model ids with their key numbers, the evolution presets, the limits
  POST /lab/api/simulate    what `servelab lab simulate --json` prints for the same inputs, byte for byte
  POST /lab/api/advise      what `servelab lab advise --json` prints
  GET  /lab/api/status      whether a simulation is running

Simulations run one at a time in a worker process (a second concurrent one gets 429): the same server may
be serving a model, and its event loop must keep streaming tokens, which a simulation in a thread would
hold up for its share of the GIL."""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from servelab.errors import OpenAIError
from servelab.lab import api
from servelab.lab.catalog import LOCAL_CPU, get_device, get_model, gpu_ids, model_ids
from servelab.specs import GIB
from servelab.lab.web.errors import bad_request, internal_error, lab_busy, not_found, request_too_large
from servelab.lab.web.params import LIMITS, field_message, lab_request
from servelab.lab.web.presets import DEFAULT_INPUTS, DEFAULT_STAGE, PRESETS

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {"lab.js": "text/javascript", "lab.css": "text/css"}
MAX_BODY_BYTES = 64 * 1024


WORK = {"simulate": api.simulate, "advise": api.advise}


@dataclass(frozen=True)
class LabOutcome:
    """What the worker process sends back: the JSON text, or bad input as a message and the field it is
    about (an exception's own attributes would not survive pickling)."""
    text: str | None = None
    error: str | None = None
    param: str | None = None


def run_lab(command: str, lab_input) -> LabOutcome:
    """In the worker process."""
    try:
        return LabOutcome(text=api.format_json(WORK[command](lab_input).to_json()))
    except ValueError as err:
        bad = field_message(err)
        return LabOutcome(error=str(bad), param=bad.param)


def exit_with_parent(parent_pid: int) -> None:
    """The worker's initializer: a server killed outright (SIGKILL, OOM) cannot stop its pool, so the worker
    leaves by itself once its parent is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="servelab-lab-parent-watch", daemon=True).start()


class LabRunner:
    """One simulation at a time, in a one-worker process pool (spawned on first use). The check and the
    claim happen on the loop with no await between them, so no lock is needed."""

    def __init__(self) -> None:
        self.running: str | None = None
        self._pool: ProcessPoolExecutor | None = None

    async def run(self, command: str, lab_input) -> LabOutcome:
        if self.running is not None:
            raise lab_busy()
        self.running = command
        try:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=exit_with_parent, initargs=(os.getpid(),))
            return await asyncio.get_running_loop().run_in_executor(self._pool, run_lab, command, lab_input)
        finally:
            self.running = None

    def close(self) -> None:
        """Stop the worker (waits for a simulation in progress: they are bounded by the lab's limits)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


async def _read_json(request: Request):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise request_too_large(MAX_BODY_BYTES)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise request_too_large(MAX_BODY_BYTES)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the request body is not valid JSON: {err}") from None


def catalog(live_engine: dict | None) -> dict:
    gpus = [_device_json(gpu_id, get_device(gpu_id)) for gpu_id in gpu_ids()]
    models = []
    for model_id in model_ids():
        m = get_model(model_id)
        models.append({"id": model_id, "name": m.name, "num_params_b": m.num_params / 1e9,
                       "weight_gib_bf16": m.weight_bytes("bfloat16") / GIB,
                       "kv_kib_per_token_bf16": m.kv_bytes_per_token("bfloat16") / 1024,
                       "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
                       "max_position_embeddings": m.max_position_embeddings})
    local = _local_cpu()
    if local:
        gpus.append(local)
    return {"gpus": gpus, "models": models, "presets": PRESETS, "default_stage": DEFAULT_STAGE,
            "defaults": DEFAULT_INPUTS, "limits": LIMITS, "live_engine": live_engine}


def _local_cpu() -> dict | None:
    from servelab.lab.catalog.cpu_profile import load_cpu_profile
    try:
        profile = load_cpu_profile()
    except ValueError:
        return None
    return {**_device_json(LOCAL_CPU, profile.device), "profiled_model": profile.fit.get("model")}


def _device_json(device_id: str, d) -> dict:
    return {"id": device_id, "name": d.name, "memory_gib": d.memory_bytes / GIB, "bf16_tflops": d.flops / 1e12,
            "memory_bandwidth_gb_s": d.memory_bandwidth / 1e9, "interconnect": d.interconnect,
            "gpus_per_node": d.gpus_per_node}


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_lab_router(live_engine: dict | None = None) -> APIRouter:
    """live_engine: where the page finds the serving engine's meters ({"metrics_stream": url,
    "needs_api_key": bool}), or None when no model is served (`servelab lab web`)."""
    runner = LabRunner()

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await asyncio.to_thread(runner.close)

    router = APIRouter(lifespan=lifespan)

    @router.get("/lab")
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    @router.get("/lab/static/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return _error(not_found(f"no lab asset {name!r}"))
        return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @router.get("/lab/api/catalog")
    async def get_catalog() -> Response:
        return JSONResponse(catalog(live_engine))

    @router.get("/lab/api/status")
    async def status() -> Response:
        return JSONResponse({"running": runner.running})

    async def run(command: str, request: Request) -> Response:
        try:
            lab_input = lab_request(command, await _read_json(request))
            outcome = await runner.run(command, lab_input)
        except OpenAIError as err:
            return _error(err)
        except ValueError as err:
            bad = field_message(err)
            return _error(bad_request(str(bad), param=bad.param))
        except Exception as err:  # a bug, not bad input: say so without a traceback
            logger.exception("lab %s failed", command)
            return _error(internal_error(f"the lab {command} failed: {type(err).__name__}: {err}"))
        if outcome.error is not None:
            return _error(bad_request(outcome.error, param=outcome.param))
        return Response(outcome.text, media_type="application/json")

    @router.post("/lab/api/simulate")
    async def simulate(request: Request) -> Response:
        return await run("simulate", request)

    @router.post("/lab/api/advise")
    async def advise(request: Request) -> Response:
        return await run("advise", request)

    return router
