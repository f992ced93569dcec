"""The lab API over real HTTP (`servelab lab web` on 127.0.0.1): the same bytes as the command line, errors
that name the field, one simulation at a time."""
from __future__ import annotations

import json
import re
import subprocess
import threading
import time

import httpx
import pytest

from servelab.testing.server import servelab_command
from servelab.lab.catalog import gpu_ids, model_ids
from servelab.lab.cli import main as lab_main

TARGET_FLAGS = {"ttft_target_ms": "--ttft-target", "tpot_target_ms": "--tpot-target"}
SMALL = {"model": "llama-3.1-8b", "gpu": "h100", "num_prompts": 60, "request_rate": 6, "dataset": "sharegpt-like",
         "ttft_target_ms": 500, "seed": 3}


def lab_argv(command: str, body: dict) -> list[str]:
    """The command-line flags for an API body, written out independently of the server's own mapping."""
    argv = [command]
    for field, value in body.items():
        if value is None:
            continue
        if field in TARGET_FLAGS:
            argv += [TARGET_FLAGS[field], f"{value}ms"]
        elif isinstance(value, dict):
            argv += ["--" + field.replace("_", "-"), json.dumps(value)]
        else:
            argv += ["--" + field.replace("_", "-"), str(value)]
    return [*argv, "--json"]


def command_output(capsys, command: str, body: dict) -> tuple[int, str]:
    code = lab_main(lab_argv(command, body))
    return code, capsys.readouterr().out


def post(url: str, command: str, body, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/lab/api/{command}", json=body, timeout=60, **kwargs)


def test_catalog_lists_the_catalogs_presets_and_limits(lab_web):
    catalog = httpx.get(f"{lab_web.url}/lab/api/catalog", timeout=10).json()
    assert [g["id"] for g in catalog["gpus"]][:len(gpu_ids())] == gpu_ids()
    assert [m["id"] for m in catalog["models"]] == model_ids()
    h100 = next(g for g in catalog["gpus"] if g["id"] == "h100")
    assert h100["memory_gib"] == 80 and h100["bf16_tflops"] == pytest.approx(989)
    llama70 = next(m for m in catalog["models"] if m["id"] == "llama-3.1-70b")
    assert llama70["weight_gib_bf16"] == pytest.approx(131.4, abs=0.1) and llama70["num_key_value_heads"] == 8
    assert [p["stage"] for p in catalog["presets"]] == [1, 2, 3, 4, 5, 6]
    assert catalog["defaults"] == catalog["presets"][catalog["default_stage"] - 1]["inputs"]
    assert catalog["limits"]["num_prompts"] == 5000
    assert catalog["live_engine"] is None  # no model behind `lab web`


def test_simulate_is_byte_identical_to_the_command(lab_web, capsys):
    catalog = httpx.get(f"{lab_web.url}/lab/api/catalog", timeout=10).json()
    bodies = [p["inputs"] for p in catalog["presets"]]
    bodies.append({**SMALL, "burstiness": 0.5, "tpot_target_ms": 20, "max_num_seqs": 32, "request_rate": "inf"})
    bodies.append({**SMALL, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                   "spec_acceptance_rate": 0.7})
    for body in bodies:
        response = post(lab_web.url, "simulate", body)
        code, printed = command_output(capsys, "simulate", body)
        assert response.status_code == 200 and code == 0, response.text
        assert response.headers["content-type"] == "application/json"
        assert response.text == printed
        assert response.json()["deployment"]["schedule"] == body.get("schedule", "continuous")
    # and against the installed command itself, in its own process
    body = catalog["defaults"]
    cli = subprocess.run([*servelab_command(), "lab", *lab_argv("simulate", body)], capture_output=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert post(lab_web.url, "simulate", body).content == cli.stdout


def test_a_deployment_that_does_not_fit_is_reported_not_refused(lab_web, capsys):
    body = {**SMALL, "model": "llama-3.1-70b", "gpu": "l4"}
    response = post(lab_web.url, "simulate", body)
    code, printed = command_output(capsys, "simulate", body)
    assert response.status_code == 200 and code == 1
    assert response.text == printed
    payload = response.json()
    assert payload["fits"] is False and "GiB" in payload["reason"] and payload["metrics"] == {}


def test_advise_is_byte_identical_to_the_command(lab_web, capsys):
    body = {**SMALL, "tpot_target_ms": 50, "max_gpus": 8}
    response = post(lab_web.url, "advise", body)
    code, printed = command_output(capsys, "advise", body)
    assert response.status_code == 200 and code == 0, response.text
    assert response.text == printed
    decisions = [d["decision"] for d in response.json()["decisions"]]
    assert decisions == ["KV-cache management", "Continuous batching", "Tensor-parallel sharding",
                         "Prefill/decode split", "GPU autoscaling", "Token streaming"]


@pytest.mark.parametrize("command, body, param, needle", [
    ("simulate", {"num_prompts": 5001}, "num_prompts", "5000"),
    ("simulate", {"num_prompts": "10"}, "num_prompts", "integer"),
    ("simulate", {"input_len": 32768, "output_len": 8192, "num_prompts": 1000}, "num_prompts", "tokens"),
    ("simulate", {"num_gpus": 4, "tp": 3}, "num_gpus", "not a multiple of tp 3"),
    ("simulate", {"gpu": "h900"}, "gpu", "h100"),
    ("simulate", {"model": "/etc/hosts"}, "model", "llama-3.1-8b"),
    ("simulate", {"request_rate": "fast"}, "request_rate", "inf"),
    ("simulate", {"request_rate": 0}, "request_rate", "> 0"),
    ("simulate", {"disaggregate": "2"}, "disaggregate", "P:D"),
    ("simulate", {"disaggregate": "1:1", "num_gpus": 3}, "disaggregate", "needs 2 GPUs"),
    ("simulate", {"schedule": "greedy"}, "schedule", "continuous"),
    ("simulate", {"range_ratio": 1}, "range_ratio", "[0, 1)"),
    ("simulate", {"ttft_target_ms": -5}, "ttft_target_ms", "> 0"),
    ("simulate", {"seed": True}, "seed", "integer"),
    ("simulate", {"colour": "red"}, "colour", "unknown field"),
    ("simulate", {"max_gpus": 4}, "max_gpus", "unknown field"),
    ("simulate", {"spec_acceptance_rate": 1.5}, "spec_acceptance_rate", "1"),
    ("simulate", {"speculative_config": {"method": "ngram"}, "spec_acceptance_rate": 0.5}, "speculative_config",
     "num_speculative_tokens"),
    ("simulate", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config",
     "spec_acceptance_rate"),
    ("simulate", {"router": "random"}, "router", "least-loaded"),
    ("simulate", {"dataset": "prefix-shared", "prefix_len": 40000}, "prefix_len", "32768"),
    ("simulate", {"dataset": "prefix-shared", "num_prefixes": 0}, "num_prefixes", "5000"),
    ("simulate", {"dataset": "random", "prefix_len": 512}, "prefix_len", "prefix-shared"),
    ("advise", {"ttft_target_ms": 500, "router": "nearest"}, "router", "prefix"),
    ("advise", {"ttft_target_ms": None}, "ttft_target_ms", "advise needs ttft_target_ms"),
    ("advise", {"ttft_target_ms": 500, "max_gpus": 1000}, "max_gpus", "64"),
])
def test_bad_input_is_a_400_naming_the_field(lab_web, command, body, param, needle):
    response = post(lab_web.url, command, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert needle in error["message"] and "Traceback" not in response.text


def test_malformed_and_oversized_bodies(lab_web):
    url = f"{lab_web.url}/lab/api/simulate"
    not_json = httpx.post(url, content=b"{model: h100", headers={"Content-Type": "application/json"}, timeout=10)
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    not_object = httpx.post(url, json=[1, 2], timeout=10)
    assert not_object.status_code == 400 and "JSON object" in not_object.json()["error"]["message"]
    too_big = httpx.post(url, json={"model": "x" * 70_000}, timeout=10)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"


def test_a_second_simulation_while_one_runs_gets_429_and_the_advisor_runs_beside_it(lab_web):
    long_body = {"model": "llama-3.1-8b", "gpu": "h100", "dataset": "sharegpt-like", "num_prompts": 5000,
                 "request_rate": 50}
    first: dict = {}
    worker = threading.Thread(target=lambda: first.update(response=post(lab_web.url, "simulate", long_body)))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(f"{lab_web.url}/lab/api/status", timeout=5).json()["running"] != "simulate":
            assert time.monotonic() < deadline and worker.is_alive(), "the first simulation never showed as running"
            time.sleep(0.01)
        # inputs no earlier test asked for: a kept answer would come back without the lane (routes.AnswerMemo)
        second = post(lab_web.url, "simulate", {**SMALL, "seed": 1234})
        beside = post(lab_web.url, "advise", {**SMALL, "seed": 1234})  # the advisor's own worker: the page's meters never wait on it
        still_running = worker.is_alive()
    finally:
        worker.join(timeout=120)
    assert still_running  # both answers came while the long simulation ran
    assert beside.status_code == 200 and beside.json()["recommendation"] is not None, beside.text
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "lab_busy" and second.headers["retry-after"] == "1"
    assert first["response"].status_code == 200 and first["response"].json()["metrics"]["completed"] == 5000
    assert httpx.get(f"{lab_web.url}/lab/api/status", timeout=5).json()["running"] is None
    assert post(lab_web.url, "simulate", SMALL).status_code == 200


def test_page_and_assets_are_served(lab_web):
    page = httpx.get(f"{lab_web.url}/lab", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/lab/static/lab.js">' in page.text
    assert not re.search(r'<(script|link)[^>]*(src|href)="(https?:)?//', page.text)  # no CDN: works offline
    for name, kind in (("lab.js", "javascript"), ("lab.css", "css")):
        asset = httpx.get(f"{lab_web.url}/lab/static/{name}", timeout=10)
        assert asset.status_code == 200 and kind in asset.headers["content-type"] and len(asset.text) > 1000
    assert httpx.get(f"{lab_web.url}/lab/static/secrets.txt", timeout=10).status_code == 404
    assert httpx.get(f"{lab_web.url}/", timeout=10, follow_redirects=True).url.path == "/lab"


def test_an_advisor_asked_to_autoscale_over_a_schedule_may_hold_more_tokens():
    from servelab.lab.web.params import LabInputError, lab_request

    # the page's autoscaling ramp at its default inputs: ~2,550 requests, 3.3 M prompt + output tokens
    ramp = {"input_len": 1024, "output_len": 256, "range_ratio": 0.5, "rate_schedule": "ramp:0=0.5,300=8,600=0.5",
            "ttft_target_ms": 500}
    with pytest.raises(LabInputError, match="2,000,000 per advise") as refused:
        lab_request("advise", ramp)
    assert refused.value.param == "num_prompts"
    request = lab_request("advise", {**ramp, "autoscale": "keda", "max_replicas": 4})
    assert request.autoscale.policy == "keda" and request.workload.rate_schedule == ramp["rate_schedule"]
    with pytest.raises(LabInputError, match="4,000,000 per advise"):
        lab_request("advise", {**ramp, "input_len": 2048, "autoscale": "keda"})
