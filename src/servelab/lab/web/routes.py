"""The lab page's routes, one APIRouter for `servelab serve` and `servelab lab web` alike:

  GET  /lab                 the page (static/index.html; its scripts, styles and data under /lab/static/)
  GET  /lab/tutorial        the six stages explained, with simulated and measured figures (static/tutorial.html)
  GET  /lab/api/catalog     GPU and model ids with their key numbers, the evolution presets, the limits
  POST /lab/api/simulate    what `servelab lab simulate --json` prints for the same inputs, byte for byte
  POST /lab/api/advise      what `servelab lab advise --json` prints
  POST /lab/api/frontier    what `servelab lab advise --pareto --json` prints (the priced cost frontier)
  GET  /lab/api/status      the lab job running now, if any (the page's simulation first)
  GET  /lab/api/live/layout the serving processes (API server, engine cores with roles, TP ranks, pids);
                            `servelab serve` only
  GET  /lab/api/measured    `bench stages` results (shipped and in the results folder) beside the lab's prediction
  GET  /lab/api/measure     the "measure here" run's progress; POST starts one (under `servelab serve` only)

Lab jobs run in worker processes, one simulation and one advisor search (or measured-path prediction) at a time,
each in its own worker, so that the page's redraw never waits behind the advisor (a second concurrent job of the
same kind gets 429): the same server may be serving a model, and its event loop must keep streaming tokens, which
a simulation in a thread would hold up for its share of the GIL. The last answers are kept (AnswerMemo): a
simulation is a pure function of its input, the shipped calibration and the local-cpu profile, so going back to a
setting, or switching the page's language, answers at once.

Every human-readable error message comes in the request's language (`?lang=zh` or Accept-Language, see
messages.py); the `param` and the bodies of successful answers do not depend on it."""
from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from servelab.bench.results import DEFAULT_DIR
from servelab.errors import OpenAIError
from servelab.lab import api
from servelab.lab.catalog import LOCAL_CPU, get_device, get_model, gpu_ids, model_ids
from servelab.lab.catalog.calibration import load_calibration
from servelab.lab.catalog.cpu_profile import profile_path
from servelab.specs import GIB
from servelab.lab.web.errors import (bad_request, internal_error, lab_busy, measure_unavailable, not_found,
                                     request_too_large)
from servelab.lab.web.measured import MeasureJob, MeasuredRequest, measured_path
from servelab.lab.web.i18n import Message, request_language
from servelab.lab.web.params import LIMITS, LabInputError, field_message, lab_request
from servelab.lab.web.presets import DEFAULT_INPUTS, DEFAULT_STAGE, PRESETS

LAYOUT_ROUTE = "/lab/api/live/layout"

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
# The only files served under /lab/static/: a name is looked up here, never joined to a path as given.
ASSETS = {
    "lab.js": "text/javascript", "i18n.js": "text/javascript", "phrases.js": "text/javascript",
    "walkthrough.js": "text/javascript", "tutorial.js": "text/javascript", "layout.js": "text/javascript",
    "lab.css": "text/css", "autoscale.js": "text/javascript", "measured.js": "text/javascript",
    "frontier.js": "text/javascript",
    "i18n/en.json": "application/json", "i18n/zh.json": "application/json",
    # a copy of benchmarks/stages/stages-smollm2/stages-smollm2.json (`servelab bench stages`)
    "measured/stages.json": "application/json",
}
PAGES = {"/lab": "index.html", "/lab/tutorial": "tutorial.html"}
MAX_BODY_BYTES = 64 * 1024


WORK = {"simulate": api.simulate, "advise": api.advise, "measured": measured_path, "frontier": api.frontier}
RESULTS_DIR = DEFAULT_DIR  # `servelab bench`'s default --result-dir


@dataclass(frozen=True)
class LabOutcome:
    """What the worker process sends back: the JSON text, or bad input as a message and the field it is
    about (an exception's own attributes would not survive pickling)."""
    text: str | None = None
    error: LabInputError | None = None


def run_lab(command: str, lab_input) -> LabOutcome:
    """In the worker process."""
    try:
        return LabOutcome(text=api.format_json(WORK[command](lab_input).to_json()))
    except ValueError as err:
        return LabOutcome(error=field_message(err))


def exit_with_parent(parent_pid: int) -> None:
    """The worker's initializer: a server killed outright (SIGKILL, OOM) cannot stop its pool, so the worker
    leaves by itself once its parent is gone."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="servelab-lab-parent-watch", daemon=True).start()


# The page's meters wait on "simulate"; the advisor's search and the measured path's predictions run beside it in a
# second worker, so that an input change never waits behind a search of dozens of shapes.
LANES = {"simulate": "interactive", "advise": "background", "measured": "background", "frontier": "background"}


class AnswerMemo:
    """The last `size` successful answers of the pure commands (MEMOIZED), keyed by the command, the typed input's
    repr (frozen dataclasses: equal inputs, equal reprs) and the local-cpu profile's modification time (a new
    `servelab lab profile` changes what `--gpu local-cpu` answers). "measured" reads result files that a measure
    run rewrites, so it is never kept."""
    MEMOIZED = frozenset({"simulate", "advise", "frontier"})

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self._answers: OrderedDict[tuple, LabOutcome] = OrderedDict()

    def key(self, command: str, lab_input) -> tuple | None:
        if command not in self.MEMOIZED:
            return None
        try:
            profile_mtime = profile_path().stat().st_mtime_ns
        except OSError:
            profile_mtime = None
        return command, repr(lab_input), profile_mtime

    def get(self, key: tuple | None) -> LabOutcome | None:
        if key is None or key not in self._answers:
            return None
        self._answers.move_to_end(key)
        return self._answers[key]

    def put(self, key: tuple | None, outcome: LabOutcome) -> None:
        if key is None or outcome.error is not None:
            return
        self._answers[key] = outcome
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)


class LabRunner:
    """One job at a time per lane (LANES), each lane in a one-worker process pool (spawned on first use); an answer
    the memo holds skips the lane. The check and the claim happen on the loop with no await between them, so no
    lock is needed."""

    def __init__(self) -> None:
        self.running_by_lane: dict[str, str] = {}
        self._pools: dict[str, ProcessPoolExecutor] = {}
        self.memo = AnswerMemo()

    @property
    def running(self) -> str | None:
        """The job running now, the page's simulation first."""
        return self.running_by_lane.get("interactive") or self.running_by_lane.get("background")

    async def run(self, command: str, lab_input, lang: str) -> LabOutcome:
        key = self.memo.key(command, lab_input)
        known = self.memo.get(key)
        if known is not None:
            return known
        lane = LANES[command]
        if lane in self.running_by_lane:
            raise lab_busy(lang)
        self.running_by_lane[lane] = command
        try:
            if lane not in self._pools:
                self._pools[lane] = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                        initializer=exit_with_parent, initargs=(os.getpid(),))
            outcome = await asyncio.get_running_loop().run_in_executor(self._pools[lane], run_lab, command,
                                                                       lab_input)
        finally:
            del self.running_by_lane[lane]
        self.memo.put(key, outcome)
        return outcome

    def close(self) -> None:
        """Stop the workers (waits for a job in progress: they are bounded by the lab's limits)."""
        for pool in self._pools.values():
            pool.shutdown(wait=True, cancel_futures=True)
        self._pools.clear()


async def _read_json(request: Request, lang: str):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise request_too_large(MAX_BODY_BYTES, lang)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise request_too_large(MAX_BODY_BYTES, lang)
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        where = {"line": err.lineno, "column": err.colno}
        raise LabInputError(Message("not_json", {"error": str(err), **where})) from None
    except UnicodeDecodeError as err:
        raise LabInputError(Message("not_utf8", {"error": str(err), "position": err.start})) from None


def _language(request: Request) -> str:
    return request_language(request.query_params.get("lang"), request.headers.get("accept-language"))


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


def _page(file_name: str):
    async def page() -> Response:
        return FileResponse(STATIC_DIR / file_name, media_type="text/html", headers={"Cache-Control": "no-cache"})
    return page


def build_lab_router(live_engine: dict | None = None, layout: Callable[[], dict] | None = None,
                     results_dir: Path = RESULTS_DIR, measure_command: list[str] | None = None) -> APIRouter:
    """live_engine: where the page finds the serving engine's meters ({"metrics_stream": url,
    "needs_api_key": bool, "layout": url}), or None when no model is served (`servelab lab web`); with a live
    engine the page can also measure here. layout: the serving processes as JSON (engine/process_layout.py), served at
    LAYOUT_ROUTE. measure_command replaces `servelab bench stages` (tests)."""
    runner = LabRunner()
    job = MeasureJob(results_dir, measure_command)

    @asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            await job.close()
            await asyncio.to_thread(runner.close)

    router = APIRouter(lifespan=lifespan)

    for route, file_name in PAGES.items():
        router.add_api_route(route, _page(file_name), methods=["GET"])

    @router.get("/lab/static/{name:path}")
    async def asset(name: str, request: Request) -> Response:
        path = (STATIC_DIR / name).resolve() if name in ASSETS else None
        # a listed name that is a symlink out of the folder (a tampered install) is not followed
        if path is None or not path.is_relative_to(STATIC_DIR.resolve()) or not path.is_file():
            return _error(not_found(name, _language(request)))
        return FileResponse(path, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @router.get("/lab/api/catalog")
    async def get_catalog() -> Response:
        return JSONResponse(catalog(live_engine))

    if layout is not None:
        @router.get(LAYOUT_ROUTE)
        async def get_layout() -> Response:
            return JSONResponse(layout(), headers={"Cache-Control": "no-cache"})

    @router.get("/lab/api/calibration")
    async def get_calibration() -> Response:
        """The shipped calibration: its fitted constants and every reference point, published vs simulated and
        held out (cross-validated); the assumptions section links here."""
        return JSONResponse(load_calibration().to_json())

    @router.get("/lab/api/status")
    async def status() -> Response:
        return JSONResponse({"running": runner.running})

    async def run(command: str, request: Request) -> Response:
        lang = _language(request)
        try:
            lab_input = lab_request(command, await _read_json(request, lang))
            outcome = await runner.run(command, lab_input, lang)
        except OpenAIError as err:
            return _error(err)
        except ValueError as err:
            return _error(bad_request(field_message(err), lang))
        except Exception as err:  # a bug, not bad input: say so without a traceback
            logger.exception("lab %s failed", command)
            return _error(internal_error(command, err, lang))
        if outcome.error is not None:
            return _error(bad_request(outcome.error, lang))
        return Response(outcome.text, media_type="application/json")

    @router.post("/lab/api/simulate")
    async def simulate(request: Request) -> Response:
        return await run("simulate", request)

    @router.post("/lab/api/advise")
    async def advise(request: Request) -> Response:
        return await run("advise", request)

    @router.post("/lab/api/frontier")
    async def frontier(request: Request) -> Response:
        return await run("frontier", request)

    @router.get("/lab/api/measured")
    async def measured(request: Request) -> Response:
        lang = _language(request)
        try:
            outcome = await runner.run("measured", MeasuredRequest(results_dir), lang)
        except OpenAIError as err:
            return _error(err)
        return Response(outcome.text, media_type="application/json")

    @router.get("/lab/api/measure")
    async def measure_status() -> Response:
        return JSONResponse({"can_measure": live_engine is not None, **job.status()})

    @router.post("/lab/api/measure")
    async def measure(request: Request) -> Response:
        lang = _language(request)
        if live_engine is None:  # `servelab lab web` serves no model: nothing here to measure with
            return _error(measure_unavailable(lang))
        if not job.start():
            return _error(lab_busy(lang))
        return JSONResponse({"can_measure": True, **job.status()}, status_code=202)

    return router
