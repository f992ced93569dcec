"""The evolution path's presets (lab/web/presets.py) through the web API's own parameter code: the sixth card's
prefix-aware router beats least-loaded routing on the same inputs."""
from __future__ import annotations

from dataclasses import replace

from servelab.lab import api
from servelab.lab.web.params import lab_request
from servelab.lab.web.presets import DEFAULT_STAGE, PRESETS


def simulate(body: dict) -> dict:
    return api.simulate(lab_request("simulate", body)).to_json()


def test_the_sixth_card_routes_replicas_by_prefix_on_a_prefix_shared_workload():
    inputs = PRESETS[5]["inputs"]
    assert PRESETS[5]["stage"] == 6 and DEFAULT_STAGE == 3
    assert inputs["router"] == "prefix" and inputs["dataset"] == "prefix-shared"
    assert inputs["num_gpus"] // inputs["tp"] > 1 and inputs["disaggregate"] is None  # replicas to choose from
    assert all(p["inputs"]["router"] == "round-robin" and p["inputs"]["prefix_len"] is None for p in PRESETS[:5])


def test_the_prefix_router_hits_more_and_answers_sooner_than_least_loaded():
    inputs = PRESETS[5]["inputs"]
    prefix = simulate(inputs)
    least_loaded = simulate({**inputs, "router": "least-loaded"})
    assert prefix["fits"] and least_loaded["fits"]
    assert prefix["deployment"]["router"] == "prefix" and least_loaded["deployment"]["router"] == "least-loaded"
    hits, hits_ll = prefix["meters"]["prefix_cache"]["hit_rate"], least_loaded["meters"]["prefix_cache"]["hit_rate"]
    assert hits > hits_ll + 0.15, (hits, hits_ll)
    assert prefix["metrics"]["median_ttft_ms"] < least_loaded["metrics"]["median_ttft_ms"] / 2
    assert prefix["metrics"]["p99_ttft_ms"] < least_loaded["metrics"]["p99_ttft_ms"]
    # the figures the card's "watch" line quotes (stage.6.watch in static/i18n/*.json): 47% -> 73%, ~200 -> 34 ms
    assert (round(hits_ll * 100), round(hits * 100)) == (47, 73)
    assert 190 <= least_loaded["metrics"]["median_ttft_ms"] <= 210 and round(prefix["metrics"]["median_ttft_ms"]) == 34
    # the same requests arrive either way: only where they are served differs
    assert prefix["metrics"]["completed"] == least_loaded["metrics"]["completed"] == inputs["num_prompts"]


def test_the_request_carries_the_router_and_the_prefix_shape():
    request = lab_request("simulate", PRESETS[5]["inputs"])
    assert request.deployment.router == "prefix"
    assert (request.workload.prefix_len, request.workload.num_prefixes) == (4096, 64)
    assert replace(request.workload, prefix_len=None).effective_prefix_len == 256  # the dataset's default
