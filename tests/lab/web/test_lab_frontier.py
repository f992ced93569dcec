"""The cost frontier on the lab page and its API against a real `servelab lab web`: POST /lab/api/frontier answers
what the lab API computes for the same request (the command's code path), the page's panel draws that answer's
points, frontier and cheapest configuration, in English and in Chinese, and bad input is a 400 naming the field."""
from __future__ import annotations

import json

import httpx
import pytest

from lab_helpers import TIMEOUT_MS, api_simulate
from servelab.lab import api
from servelab.lab.web.params import lab_request

SMALL = {"model": "llama-3.1-8b", "gpus": ["h100", "a100-80gb"], "max_gpus": 2, "num_prompts": 40,
         "request_rate": 8, "input_len": 512, "output_len": 64, "ttft_target_ms": 300}


def test_frontier_api_answers_what_the_lab_api_computes(lab_web):
    answer = api_simulate(lab_web.url, {**SMALL, "prices": {"h100": 2.0}}, command="frontier")
    expected = json.loads(api.format_json(api.frontier(lab_request("frontier", {**SMALL, "prices": {"h100": 2.0}}))
                                          .to_json()))
    assert answer == expected
    assert {p["gpu"] for p in answer["points"]} == {"h100", "a100-80gb"}
    assert all(p["usd_per_gpu_hour"] == 2.0 for p in answer["points"] if p["gpu"] == "h100")
    assert answer["cheapest"]["meets_targets"]


@pytest.mark.parametrize("body, param", [
    ({**SMALL, "gpus": ["tpu"]}, "gpus"),
    ({**SMALL, "gpus": []}, "gpus"),
    ({**SMALL, "max_gpus": 64}, "max_gpus"),
    ({**SMALL, "prices": {"h100": -1}}, "prices"),
    ({**SMALL, "ttft_target_ms": None}, "ttft_target_ms"),
    ({**SMALL, "gpu": "h100"}, "gpu"),
])
def test_bad_frontier_input_is_a_400_naming_the_field(lab_web, body, param):
    response = httpx.post(f"{lab_web.url}/lab/api/frontier", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("lang, cheapest_word", [("en", "Cheapest meeting the targets"), ("zh", "满足目标的最便宜配置")])
def test_the_page_draws_the_frontier_and_the_cheapest_point(open_lab, lab_web, lang, cheapest_word):
    page = open_lab(lab_web.url, f"/lab?lang={lang}")
    page.wait_for_function("document.getElementById('meters').dataset.status === 'ready'", timeout=TIMEOUT_MS)
    page.uncheck("#fr-gpu-a100-80gb")
    page.fill("#fr-max", "4")
    page.fill("#fr-price-h100", "2.5")
    page.click("#fr-run")
    page.wait_for_function("['ready', 'error'].includes(document.getElementById('frontier').dataset.status)",
                           timeout=TIMEOUT_MS)
    assert page.get_attribute("#frontier", "data-status") == "ready", page.inner_text("#fr-status")
    body = json.loads(page.get_attribute("#frontier", "data-body"))
    assert body["gpus"] == ["h100", "h200", "mi300x"] and body["max_gpus"] == 4 and body["prices"] == {"h100": 2.5}
    answer = api_simulate(lab_web.url, body, command="frontier")
    assert json.loads(page.get_attribute("#frontier", "data-cheapest")) == answer["cheapest"]
    text = page.inner_text("#fr-cheapest")
    if answer["cheapest"]:
        assert cheapest_word in text and answer["cheapest"]["label"] in text
        assert f"{answer['cheapest']['usd_per_million_tokens']:.3f}" in text
    assert page.locator("#fr-plot circle.fr-point").count() == len(answer["points"])
    assert page.locator("#fr-rows tr").count() == len(answer["cost_frontier"])
