"""The measured path on the lab page: `bench stages` results (shipped and in the results folder) beside the lab's
prediction for the same workload, and "measure here": one background run at a time, its progress read from the
stage lines it prints (a stub stands in for the minute-long real comparison)."""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import httpx

from servelab.lab import api
from servelab.lab.catalog import LOCAL_CPU
from servelab.lab.catalog.cpu_profile import save_cpu_profile
from servelab.lab.web.measured import SHIPPED, MeasuredRequest, MeasureJob, measured_path
from servelab.workload import WorkloadConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))
from test_profile import make_profile  # noqa: E402

# Prints what `bench stages` prints when it starts each stage's server, then writes a result like it.
STUB = r"""
import json, pathlib, sys, time
results, name = pathlib.Path(sys.argv[1]), sys.argv[2]
payload = json.loads(pathlib.Path(SHIPPED).read_text())
for label in ("1 serial", "2 static batching", "3 continuous + paged"):
    print(f"{label}: starting servelab serve --schedule x", flush=True)
    time.sleep(0.05)
(results / name).mkdir(parents=True)
(results / name / f"{name}.json").write_text(json.dumps({**payload, "name": name}))
"""


def test_results_sit_beside_the_labs_prediction_for_the_same_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))
    save_cpu_profile(make_profile())
    here = tmp_path / "results" / "stages-here"
    here.mkdir(parents=True)
    shipped = json.loads(SHIPPED.read_text())
    (here / "stages-here.json").write_text(json.dumps({**shipped, "name": "stages-here"}))
    copy = tmp_path / "results" / "stages-smollm2"  # the repository's copy of the shipped run: listed once
    copy.mkdir()
    shutil.copy(SHIPPED, copy / "stages-smollm2.json")
    tp_only = tmp_path / "results" / "stages-tp"  # only stages the panel does not predict: no empty table
    tp_only.mkdir()
    (tp_only / "stages-tp.json").write_text(json.dumps(
        {**shipped, "name": "stages-tp", "runs": [r for r in shipped["runs"] if r["schedule"] in ("tp", "disaggregated")]}))
    (tmp_path / "results" / "serve-x").mkdir()
    (tmp_path / "results" / "serve-x" / "serve-x.json").write_text(json.dumps({"command": "servelab bench serve"}))
    sets = measured_path(MeasuredRequest(tmp_path / "results")).to_json()["sets"]
    assert [s["source"] for s in sets] == ["shipped", str(here / "stages-here.json")]
    for s in sets:
        assert [r["schedule"] for r in s["runs"]] == ["serial", "static", "continuous"]
        assert s["runs"][2]["p99_ttft_ms"] == shipped["runs"][2]["p99_ttft_ms"]
        # the prediction is the lab's own answer for the measured workload
        w = WorkloadConfig(dataset="random", num_prompts=shipped["num_prompts"], input_len=shipped["input_len"],
                           output_len=shipped["output_len"], range_ratio=shipped["range_ratio"],
                           request_rate=shipped["request_rate"], seed=shipped["seed"])
        d = api.DeploymentRequest(model="smollm2-135m", gpu=LOCAL_CPU, schedule="static",
                                  max_num_seqs=shipped["max_num_seqs"])
        metrics = api.simulate(api.SimulateRequest(d, w)).evaluation.metrics
        assert s["predicted"][1]["output_throughput"] == metrics["output_throughput"]
        assert s["predicted"][1]["p99_ttft_ms"] == metrics["p99_ttft_ms"]


def test_without_a_cpu_profile_the_results_still_show(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "empty"))
    (only,) = measured_path(MeasuredRequest(tmp_path / "none")).to_json()["sets"]
    assert "predicted" not in only and "servelab lab profile" in only["prediction_error"]
    assert len(only["runs"]) == 3


def test_measure_here_runs_one_at_a_time_and_reports_each_stage(tmp_path):
    stub = tmp_path / "stub.py"
    stub.write_text(STUB.replace("SHIPPED", repr(str(SHIPPED))))

    async def scenario():
        job = MeasureJob(tmp_path / "results", [sys.executable, str(stub)])
        assert job.start()
        assert not job.start()  # a second run waits for the first
        stages = set()
        for _ in range(600):
            stages.add(job.stage)
            if job.state != "running":
                break
            await asyncio.sleep(0.02)
        return job, stages

    job, stages = asyncio.run(scenario())
    assert job.state == "done" and job.stage == 3 and stages <= {0, 1, 2, 3}
    assert (tmp_path / "results" / job.name / f"{job.name}.json").is_file()
    assert job.status()["log_tail"][-1].startswith("3 continuous")


def test_lab_web_lists_the_shipped_results_and_cannot_measure_without_a_model(lab_web):
    status = httpx.get(f"{lab_web.url}/lab/api/measure", timeout=10).json()
    assert status["can_measure"] is False and status["state"] == "idle"
    refused = httpx.post(f"{lab_web.url}/lab/api/measure?lang=zh", timeout=10)
    assert refused.status_code == 404 and "servelab serve" in refused.json()["error"]["message"]
    for _ in range(240):
        response = httpx.get(f"{lab_web.url}/lab/api/measured", timeout=60)
        if response.status_code != 429:
            break
    sets = response.json()["sets"]
    assert sets[0]["source"] == "shipped" and len(sets[0]["runs"]) == 3



def test_the_measure_route_under_serve_starts_one_run_and_reports_its_progress(tmp_path):
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from servelab.lab.web.routes import build_lab_router

    stub = tmp_path / "stub.py"
    stub.write_text(STUB.replace("SHIPPED", repr(str(SHIPPED))))
    app = FastAPI()
    router = build_lab_router(live_engine={"metrics_stream": "/v1/metrics/stream", "needs_api_key": False},
                              results_dir=tmp_path / "results", measure_command=[sys.executable, str(stub)])
    app.include_router(router)
    with TestClient(app) as client:
        started = client.post("/lab/api/measure")
        assert started.status_code == 202 and started.json()["state"] == "running"
        assert client.post("/lab/api/measure").status_code == 429  # one at a time
        for _ in range(600):
            status = client.get("/lab/api/measure").json()
            if status["state"] != "running":
                break
            time.sleep(0.02)
        assert status == {**status, "state": "done", "stage": 3, "num_stages": 3, "can_measure": True}
    assert (tmp_path / "results" / status["name"] / f"{status['name']}.json").is_file()
