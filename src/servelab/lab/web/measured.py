"""The measured evolution path on the lab page: `servelab bench stages` results (the copy the page ships and those
in the user's results folder), each stage beside the lab's prediction for the same workload on this machine (the
local-cpu profile of `servelab lab profile`, priced as `servelab lab validate` prices each stage: -tp 3 with the
profile's all-reduce timing, --disaggregate 1:1 with its KV-transfer timing on shared cores), and "measure here":
a short stage comparison in the background, one at a time, under `servelab serve`."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from servelab.bench.stages import STAGES
from servelab.lab.calibrate.validate import simulated_metrics
from servelab.lab.catalog import get_model
from servelab.lab.catalog.cpu_profile import load_cpu_profile
from servelab.workload import WorkloadConfig

SHIPPED = Path(__file__).parent / "static" / "measured" / "stages.json"
STAGE_COLUMNS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
PREDICTED_MODEL = "smollm2-135m"  # the model `bench stages` serves by default, and the one the profile measures
# A short comparison: a server of the default model per stage (all five), 16 requests each.
MEASURE_ARGS = ["--num-prompts", "16", "--input-len", "32", "--output-len", "16", "--range-ratio", "0.5",
                "--request-rate", "4", "--max-num-seqs", "8", "--seed", "0", "--stages", ",".join(STAGES),
                "--disable-tqdm"]


@dataclass(frozen=True)
class MeasuredRequest:
    results_dir: Path


@dataclass(frozen=True)
class MeasuredPath:
    sets: list[dict]

    def to_json(self) -> dict:
        return {"sets": self.sets}


def measured_path(request: MeasuredRequest) -> MeasuredPath:
    """In the lab's worker process: reading the results and predicting them simulates."""
    sets = [_with_prediction(payload, source) for payload, source in _stage_results(request.results_dir)]
    return MeasuredPath([s for s in sets if s["runs"]])


def _stage_results(results_dir: Path) -> list[tuple[dict, str]]:
    shipped = json.loads(SHIPPED.read_text())
    found = [(shipped, "shipped")]
    seen = {(shipped.get("name"), shipped.get("date"))}  # the shipped file is a copy of one in the repository
    for path in sorted(results_dir.glob("*/*.json")) if results_dir.is_dir() else []:
        try:
            payload = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(payload, dict) and str(payload.get("command", "")).startswith("servelab bench stages") \
                and (payload.get("name"), payload.get("date")) not in seen:
            seen.add((payload.get("name"), payload.get("date")))
            found.append((payload, str(path)))
    return found


def _with_prediction(payload: dict, source: str) -> dict:
    runs = [r for r in payload.get("runs", []) if r.get("schedule") in STAGES]
    out = {"source": source, "name": payload.get("name"), "date": payload.get("date"),
           "machine": payload.get("machine", {}), "model_id": payload.get("model_id"),
           "command": payload.get("command"),
           "workload": {k: payload.get(k) for k in ("num_prompts", "input_len", "output_len", "range_ratio",
                                                     "request_rate", "max_num_seqs", "seed")},
           "runs": [{"stage": r["stage"], "schedule": r["schedule"], **{k: r.get(k) for k in STAGE_COLUMNS}}
                    for r in runs]}
    try:
        profile = load_cpu_profile()
        spec = get_model(PREDICTED_MODEL)
        profile.check_model(spec)
    except ValueError as err:  # no CPU profile here, or one of another model
        out["prediction_error"] = str(err)
        return out
    out["predicted"] = [_predict(profile, spec, payload, r["schedule"]) for r in runs]
    return out


def _predict(profile, spec, payload: dict, schedule: str) -> dict:
    """What `servelab lab validate --stages <schedule>` simulates for the measured workload. A stage the profile
    cannot price (one from before it timed all-reduces or KV transfers) or whose workload does not fit carries
    the reason instead of figures."""
    w = WorkloadConfig(dataset="random", num_prompts=payload["num_prompts"], input_len=payload["input_len"],
                       output_len=payload["output_len"], range_ratio=payload.get("range_ratio", 0.0),
                       request_rate=float(payload["request_rate"]), burstiness=payload.get("burstiness", 1.0),
                       seed=payload.get("seed", 0))
    try:
        metrics = simulated_metrics(profile, spec, schedule, payload["max_num_seqs"], w)
    except ValueError as err:
        return {"schedule": schedule, "error": str(err)}
    return {"schedule": schedule, **{k: metrics.get(k) for k in STAGE_COLUMNS}}


@dataclass
class MeasureJob:
    """One `servelab bench stages` at a time, its progress read from the lines it prints."""
    results_dir: Path
    command: list[str] | None = None  # tests give a stub; None: the real short comparison
    state: str = "idle"  # idle | running | done | failed
    stage: int = 0
    name: str | None = None
    lines: list[str] = field(default_factory=list)
    _task: asyncio.Task | None = None

    def status(self) -> dict:
        return {"state": self.state, "stage": self.stage, "num_stages": len(STAGES), "name": self.name,
                "log_tail": self.lines[-5:]}

    def start(self) -> bool:
        """False when a run is in progress."""
        if self.state == "running":
            return False
        self.name = f"stages-here-{time.strftime('%Y%m%d-%H%M%S')}"
        self.state, self.stage, self.lines = "running", 0, []
        self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    def argv(self) -> list[str]:
        if self.command is not None:
            return [*self.command, str(self.results_dir), self.name]
        return [sys.executable, "-m", "servelab.entrypoints.cli", "bench", "stages", *MEASURE_ARGS,
                "--name", self.name, "--result-dir", str(self.results_dir)]

    async def _run(self) -> None:
        try:
            proc = await asyncio.create_subprocess_exec(*self.argv(), stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as err:
            self.lines.append(str(err))
            self.state = "failed"
            return
        try:
            async for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                if ": starting servelab serve" in line:  # "<n> <stage>...: starting servelab serve ..."
                    self.stage = int(line.split()[0]) if line.split()[0].isdigit() else self.stage + 1
            self.state = "done" if await proc.wait() == 0 else "failed"
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
        except Exception as err:  # the log says why; the page shows the state
            self.lines.append(f"{type(err).__name__}: {err}")
            self.state = "failed"

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
