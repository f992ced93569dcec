"""The measured path on the lab page: `bench stages` results (shipped and in the results folder) beside the lab's
prediction for the same workload, and "measure here": one background run at a time, its progress read from the
stage lines it prints (a stub stands in for the minute-long real comparison)."""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from servelab.lab import api
from servelab.lab.calibrate.validate import simulated_metrics
from servelab.lab.catalog import LOCAL_CPU, get_model
from servelab.lab.catalog.cpu_profile import load_cpu_profile, save_cpu_profile
from servelab.lab.web.measured import SHIPPED, MeasuredRequest, MeasureJob, measured_path
from servelab.workload import WorkloadConfig

from lab_helpers import TIMEOUT_MS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "calibrate"))
from test_all_reduce_profile import with_all_reduce  # noqa: E402
from test_profile import make_profile  # noqa: E402

# Prints what `bench stages` prints when it starts each stage's server, then writes a result like it.
STUB = r"""
import json, pathlib, sys, time
results, name = pathlib.Path(sys.argv[1]), sys.argv[2]
payload = json.loads(pathlib.Path(SHIPPED).read_text())
for label in ("1 serial", "2 static batching", "3 continuous + paged", "4 tensor parallel -tp 3",
              "5 disaggregated 1:1"):
    print(f"{label}: starting servelab serve --schedule x", flush=True)
    time.sleep(0.05)
(results / name).mkdir(parents=True)
(results / name / f"{name}.json").write_text(json.dumps({**payload, "name": name}))
"""


def profile_for_every_stage():
    """A CPU profile that prices all five stages: tp 3 with a timed all-reduce, 1:1 with a timed KV transfer."""
    return replace(with_all_reduce(make_profile()), kv_transfer={"latency_s": 1e-3, "bytes_per_s": 1e9})


def shipped_workload(shipped: dict) -> WorkloadConfig:
    return WorkloadConfig(dataset="random", num_prompts=shipped["num_prompts"], input_len=shipped["input_len"],
                          output_len=shipped["output_len"], range_ratio=shipped["range_ratio"],
                          request_rate=shipped["request_rate"], seed=shipped["seed"])


def test_results_sit_beside_the_labs_prediction_for_the_same_workload(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))
    profile = profile_for_every_stage()
    save_cpu_profile(profile)
    here = tmp_path / "results" / "stages-here"
    here.mkdir(parents=True)
    shipped = json.loads(SHIPPED.read_text())
    (here / "stages-here.json").write_text(json.dumps({**shipped, "name": "stages-here"}))
    copy = tmp_path / "results" / "stages-smollm2"  # the repository's copy of the shipped run: listed once
    copy.mkdir()
    shutil.copy(SHIPPED, copy / "stages-smollm2.json")
    tp_only = tmp_path / "results" / "stages-tp"  # a run of stage 4 alone
    tp_only.mkdir()
    (tp_only / "stages-tp.json").write_text(json.dumps(
        {**shipped, "name": "stages-tp", "runs": [r for r in shipped["runs"] if r["schedule"] == "tp"]}))
    (tmp_path / "results" / "serve-x").mkdir()
    (tmp_path / "results" / "serve-x" / "serve-x.json").write_text(json.dumps({"command": "servelab bench serve"}))
    sets = measured_path(MeasuredRequest(tmp_path / "results")).to_json()["sets"]
    assert [s["source"] for s in sets] == ["shipped", str(here / "stages-here.json"), str(tp_only / "stages-tp.json")]
    assert [r["schedule"] for r in sets[2]["runs"]] == ["tp"]
    stages = ["serial", "static", "continuous", "tp", "disaggregated"]
    spec = get_model("smollm2-135m")
    # each stage's prediction is what `servelab lab validate --stages <stage>` simulates for the measured workload
    expected = {stage: simulated_metrics(load_cpu_profile(), spec, stage, shipped["max_num_seqs"],
                                         shipped_workload(shipped)) for stage in stages}
    for s in sets[:2]:
        assert [r["schedule"] for r in s["runs"]] == stages
        assert s["runs"][2]["p99_ttft_ms"] == shipped["runs"][2]["p99_ttft_ms"]
        for stage, predicted in zip(stages, s["predicted"]):
            assert predicted["schedule"] == stage and "error" not in predicted
            for key in ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms"):
                assert predicted[key] == expected[stage][key], (stage, key)
    # stage 4 pays the all-reduces of three ranks on the same cores, stage 5 a prefill instance on half of them
    assert expected["tp"]["median_tpot_ms"] > expected["continuous"]["median_tpot_ms"]
    assert expected["disaggregated"]["median_ttft_ms"] > expected["continuous"]["median_ttft_ms"]
    # stages 1-3 are the lab's own `lab simulate --gpu local-cpu` answer too
    d = api.DeploymentRequest(model="smollm2-135m", gpu=LOCAL_CPU, schedule="static",
                              max_num_seqs=shipped["max_num_seqs"])
    metrics = api.simulate(api.SimulateRequest(d, shipped_workload(shipped))).evaluation.metrics
    assert sets[0]["predicted"][1]["output_throughput"] == metrics["output_throughput"]


def test_a_stage_the_profile_cannot_price_says_why_and_the_others_are_predicted(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())  # a profile from before all-reduces and KV transfers were timed
    (only,) = measured_path(MeasuredRequest(tmp_path / "none")).to_json()["sets"]
    predicted = {p["schedule"]: p for p in only["predicted"]}
    assert all(predicted[s]["output_throughput"] > 0 for s in ("serial", "static", "continuous"))
    assert "tp 3" in predicted["tp"]["error"]  # no all-reduce timing: one "device" here
    assert "KV-transfer" in predicted["disaggregated"]["error"]
    assert "output_throughput" not in predicted["tp"] and "prediction_error" not in only


def test_without_a_cpu_profile_the_results_still_show(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "empty"))
    (only,) = measured_path(MeasuredRequest(tmp_path / "none")).to_json()["sets"]
    assert "predicted" not in only and "servelab lab profile" in only["prediction_error"]
    assert len(only["runs"]) == 5


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
    assert job.state == "done" and job.stage == 5 and stages <= {0, 1, 2, 3, 4, 5}
    assert (tmp_path / "results" / job.name / f"{job.name}.json").is_file()
    assert job.status()["log_tail"][-1].startswith("5 disaggregated")
    # the real comparison runs the five stages the panel shows
    assert job.status()["num_stages"] == 5 and "serial,static,continuous,tp,disaggregated" in MeasureJob(tmp_path).argv()


def test_lab_web_lists_the_shipped_results_and_cannot_measure_without_a_model(lab_web):
    status = httpx.get(f"{lab_web.url}/lab/api/measure", timeout=10).json()
    assert status["can_measure"] is False and status["state"] == "idle"
    refused = httpx.post(f"{lab_web.url}/lab/api/measure?lang=zh", timeout=10)
    assert refused.status_code == 404 and "servelab serve" in refused.json()["error"]["message"]
    sets = fetch_measured(lab_web.url)["sets"]
    assert sets[0]["source"] == "shipped" and len(sets[0]["runs"]) == 5



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
        assert status == {**status, "state": "done", "stage": 5, "num_stages": 5, "can_measure": True}
    assert (tmp_path / "results" / status["name"] / f"{status['name']}.json").is_file()


@pytest.fixture(scope="module")
def lab_web_profiled(tmp_path_factory):
    """`servelab lab web` with a CPU profile that prices every stage, in a folder without results of its own: the
    panel shows the shipped run alone."""
    from conftest import LabWebProcess

    root = tmp_path_factory.mktemp("lab_web_profiled")
    save_cpu_profile(profile_for_every_stage(), root / "cache" / "lab" / "local-cpu.json")
    server = LabWebProcess(root / "lab-web.log", env={"SERVELAB_CACHE_DIR": str(root / "cache")}, cwd=root)
    try:
        yield server.wait_ready(timeout=60)
    finally:
        server.stop()


def test_the_page_predicts_stages_4_and_5_beside_their_measurements_in_both_languages(open_lab, lab_web_profiled):
    from test_lab_languages import english_left

    page = open_lab(lab_web_profiled.url, "/lab?lang=en")
    page.wait_for_function("document.getElementById('measured').dataset.status === 'ready'", timeout=TIMEOUT_MS)
    rows = page.locator("#ms-sets .ms-set").first.locator("tr[data-schedule]")
    assert [rows.nth(i).get_attribute("data-schedule") for i in range(rows.count())] == \
        ["serial", "static", "continuous", "tp", "disaggregated"]
    api_set = fetch_measured(lab_web_profiled.url)["sets"][0]
    for i, schedule in enumerate(("tp", "disaggregated"), start=3):
        cells = rows.nth(i).locator("td")
        assert cells.nth(0).inner_text() == language_file("en")[f"stage.{i + 1}.name"]
        predicted = api_set["predicted"][i]
        assert predicted["schedule"] == schedule
        # output tok/s, TTFT p50, TTFT p99, TPOT p50: measured, then predicted; the prediction is the API's
        for k, key in enumerate(("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")):
            text = cells.nth(2 * k + 2).inner_text()
            assert abs(number(text) - predicted[key]) <= display_step(key, predicted[key]) / 2 + 1e-6, (key, text)
    assert page.locator("#measured .ms-unpriced").count() == 0
    page.click("#lang-zh")
    page.wait_for_function("document.documentElement.lang === 'zh-CN'")
    assert rows.nth(3).locator("td").nth(0).inner_text() == language_file("zh")["stage.4.name"]
    assert english_left(page) == []


def language_file(lang: str) -> dict:
    return json.loads((SHIPPED.parents[1] / "i18n" / f"{lang}.json").read_text(encoding="utf-8"))


def fetch_measured(url: str) -> dict:
    for _ in range(240):
        response = httpx.get(f"{url}/lab/api/measured", timeout=60)
        if response.status_code != 429:
            return response.json()
        time.sleep(0.25)
    raise AssertionError("the lab stayed busy")


def number(text: str) -> float:
    """A figure as the page formats it: `61.2` tok/s, `812 ms`, `2.3 s`, `39 s`."""
    value = float(re.search(r"[\d,]+(?:\.\d+)?", text)[0].replace(",", ""))
    return value * 1000 if re.search(r"\d\s*s$", text.strip()) else value


def display_step(key: str, value: float) -> float:
    """The last digit the page shows (i18n.js fmt.num and fmt.ms)."""
    if key == "output_throughput":
        return 0.1
    return 1000 if value >= 10000 else 100 if value >= 1000 else 1 if value >= 10 else 0.1
