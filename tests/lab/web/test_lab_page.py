"""The lab page in a real browser (Debian's Chromium through Playwright) against real servers on 127.0.0.1:
the meters show what the API returns, the evolution cards and sliders re-run the simulation, the diagram follows
the stage, a deployment that does not fit says so, and under `servelab serve` the live panel streams."""
from __future__ import annotations

import json

import httpx

from lab_helpers import TIMEOUT_MS, api_simulate, wait_for_result
from servelab.testing.server import API_KEY

# meter element -> the API value it shows as data-value
METER_VALUES = {
    "kv": ("kv_cache", "peak_usage"), "weights": ("weights", "bytes_per_gpu"),
    "decode": ("decode_throughput", "utilization"), "slots": ("batch_slots", "mean_saturation"),
    "ttft": ("ttft", "p99_ms"), "tpot": ("tpot", "p99_ms"), "goodput": ("goodput", "slo_attainment"),
    "queue": ("queue", "mean_queue_ms"), "step": ("step_time", "mean_step_ms"),
}
BOTTLENECK_SOURCES = {"kv": "kv_cache", "weights": "weights", "decode": "decode_throughput", "slots": "batch_slots",
                      "ttft": "ttft", "tpot": "tpot", "goodput": "goodput", "queue": "queue", "step": "step_time"}


def meter_value(page, meter: str) -> float:
    return float(page.get_attribute(f"#meter-{meter}", "data-value"))


def assert_meters_match(page, result: dict) -> None:
    for meter, (group, key) in METER_VALUES.items():
        assert meter_value(page, meter) == result["meters"][group][key], meter
        shown_flag = "bottleneck" in page.get_attribute(f"#meter-{meter}", "class").split()
        assert shown_flag == result["meters"][BOTTLENECK_SOURCES[meter]]["bottleneck"], meter


def box_state(page, box: str) -> str:
    return page.get_attribute(f"#box-{box}", "data-state")


def test_default_page_shows_the_api_numbers_and_the_advice(open_lab, lab_web, tmp_path):
    page = open_lab(lab_web.url)
    body = json.loads(page.get_attribute("#meters", "data-body"))
    catalog = httpx.get(f"{lab_web.url}/lab/api/catalog", timeout=10).json()
    assert body == catalog["defaults"]
    result = api_simulate(lab_web.url, body)
    assert_meters_match(page, result)
    weights = result["meters"]["weights"]["bytes_per_gpu"]
    assert f"{weights / 2**30:.1f} GiB" in page.inner_text("#meter-weights .meter-value")
    p99 = result["meters"]["ttft"]["p99_ms"]
    assert f"p99 {p99:,.0f} ms" in page.inner_text("#meter-ttft .meter-value")
    assert page.inner_text("#stage-label") == "Stage 3 · continuous batching + paged attention"
    assert "current" in page.get_attribute("#stage-card-3", "class")
    assert box_state(page, "shards") == "idle" and box_state(page, "prefill") == "idle"
    assert box_state(page, "kv") == "active" and page.text_content("#title-kv") == "Paged KV cache"
    assert page.get_attribute("#meter-transfer", "hidden") is not None
    assert page.inner_text("#cli-command").startswith("servelab lab simulate --model llama-3.1-70b --gpu b200")
    # each headline figure with its error band, and the engine whose overheads priced it
    assert page.inner_text("#bands-title") == f"Expected error · engine {result['engine']}" == "Expected error · engine vllm"
    c = result["error_bands"]["calibration"]
    assert c["cross_validation"] == "leave-one-source-out"
    lead = page.inner_text("#bands-lead")
    assert "mean error on published points from sources it never saw" in lead and f"{c['num_points']} points" in lead
    for key, band in result["error_bands"]["metrics"].items():
        if key in ("median_ttft_ms", "median_tpot_ms", "output_throughput"):
            line = page.inner_text(f"#bands-list li[data-metric='{key}']")
            assert (f"{band['num_points']} points" in line if band["band"] is not None
                    else "no reference points" in line), (key, line)

    page.wait_for_function("document.getElementById('advice').dataset.status === 'ready'", timeout=TIMEOUT_MS)
    decisions = page.locator("#decisions li .decision").all_inner_texts()
    assert decisions == ["KV-cache management", "Continuous batching", "Tensor-parallel sharding",
                         "Prefill/decode split", "GPU autoscaling", "Token streaming"]
    assert "NVIDIA B200" in page.inner_text("#recommendation .shape")
    assert page.is_visible("#live") is False  # `lab web` serves no model
    page.screenshot(path=str(tmp_path / "lab-page.png"), full_page=True)
    assert (tmp_path / "lab-page.png").stat().st_size > 50_000


def test_stage_4_card_shards_the_weights_and_lights_the_shards(open_lab, lab_web):
    page = open_lab(lab_web.url)
    unsharded = meter_value(page, "weights")
    assert box_state(page, "shards") == "idle"
    page.click("#stage-card-4")
    body = wait_for_result(page, "body.tp === 4")
    assert body["num_gpus"] == 4 and body["schedule"] == "continuous" and body["disaggregate"] is None
    result = api_simulate(lab_web.url, body)
    assert_meters_match(page, result)
    sharded = meter_value(page, "weights")
    assert sharded < unsharded / 3.9
    assert box_state(page, "shards") == "active" and "new" in page.get_attribute("#box-shards", "class")
    assert box_state(page, "prefill") == "idle"
    assert page.inner_text("#stage-label").startswith("Stage 4")
    assert "whole model 131.4 GiB over TP 4" in page.inner_text("#meter-weights .meter-value")
    assert page.is_checked("#sw-tp") and page.input_value("#in-tp") == "4"

    page.click("#stage-card-5")
    body = wait_for_result(page, "body.disaggregate === '2:2'")
    states = {box: box_state(page, box) for box in ("prefill", "shards", "workers")}
    transfer_shown = page.get_attribute("#meter-transfer", "hidden") is None
    transfer = meter_value(page, "transfer")
    page.goto("about:blank")  # leave before the page asks the advisor (dozens of shapes at this scale)
    assert states == {"prefill": "active", "shards": "active", "workers": "active"} and transfer_shown
    assert transfer == api_simulate(lab_web.url, body)["meters"]["kv_transfer"]["mean_ms"]


def test_stage_6_card_routes_by_prefix_in_both_languages(open_lab, lab_web):
    shown = {}
    for lang in ("zh", "en"):  # English last: the page remembers the language for the tests after this one
        page = open_lab(lab_web.url, f"/lab?lang={lang}")
        page.click("#stage-card-6")
        body = wait_for_result(page, "body.router === 'prefix'")
        # read what the page shows at once, and leave before it asks the advisor (dozens of 16-GPU shapes)
        shown[lang] = {
            "router": page.input_value("#in-router"), "label": page.inner_text("#stage-label"),
            "card": [page.inner_text(f"#stage-card-6 .{part}") for part in ("title", "summary", "watch")],
            "current": "current" in page.get_attribute("#stage-card-6", "class").split(),
            "gateway": page.text_content("#sub-gateway"), "gateway_new": "new" in page.get_attribute("#box-gateway", "class"),
            "prefix_len": page.input_value("#in-prefix-len") if page.is_visible("#in-prefix-len") else None,
            "ttft": meter_value(page, "ttft"), "cli": page.inner_text("#cli-command"), "body": body,
        }
        page.goto("about:blank")
    result = api_simulate(lab_web.url, shown["en"]["body"])
    hits = f"{result['meters']['prefix_cache']['hit_rate'] * 100:.0f}%"
    for lang, s in shown.items():
        assert s["router"] == "prefix" and s["current"] and s["gateway_new"], lang
        assert s["body"] == shown["en"]["body"] and s["body"]["dataset"] == "prefix-shared", lang
        assert s["body"]["num_gpus"] // s["body"]["tp"] == 4 and s["prefix_len"] == "4096", lang
        assert s["ttft"] == result["meters"]["ttft"]["p99_ms"], lang  # the simulation came back and is shown
        assert hits in s["gateway"], (lang, s["gateway"])
        assert "--router prefix --dataset prefix-shared --prefix-len 4096 --num-prefixes 64" in s["cli"], lang
    assert shown["en"]["label"] == "Stage 6 · KV-cache-aware routing"
    assert shown["zh"]["label"].startswith("第 6 阶段")
    assert shown["en"]["gateway"] == f"prefix router · {hits} hits"
    assert all(en != zh for en, zh in zip(shown["en"]["card"], shown["zh"]["card"]))  # translated
    assert "least-loaded" in shown["en"]["card"][2] and "最少负载" in shown["zh"]["card"][2]


def test_moving_a_slider_reruns_the_simulation(open_lab, lab_web):
    page = open_lab(lab_web.url)
    before = meter_value(page, "decode")
    page.focus("#in-rate")
    page.keyboard.press("ArrowRight")  # 3 -> 4 requests/s
    body = wait_for_result(page, "body.request_rate === 4")
    assert page.inner_text("#out-rate") == "4.00 req/s"
    result = api_simulate(lab_web.url, body)
    assert_meters_match(page, result)
    assert meter_value(page, "decode") > before

    page.click("label.switch:has(#sw-continuous)")  # off, with 256 slots: static batches
    body = wait_for_result(page, "body.schedule === 'static'")
    assert_meters_match(page, api_simulate(lab_web.url, body))
    assert page.text_content("#title-kv") == "KV cache" and page.inner_text("#stage-label").startswith("Stage 2")


def test_a_deployment_that_does_not_fit_shows_its_numbers(open_lab, lab_web):
    page = open_lab(lab_web.url)
    assert page.is_hidden("#does-not-fit")
    page.select_option("#in-model", "llama-3.1-405b")
    body = wait_for_result(page, "body.model === 'llama-3.1-405b'")
    result = api_simulate(lab_web.url, body)
    assert result["fits"] is False
    banner = page.inner_text("#does-not-fit")
    assert banner.startswith("Does not fit") and result["reason"] in banner
    assert meter_value(page, "weights") == result["meters"]["weights"]["bytes_per_gpu"]
    assert "bottleneck" in page.get_attribute("#meter-weights", "class")
    assert "na" in page.get_attribute("#meter-kv", "class").split()
    assert "memory" in page.inner_text("#bottleneck-line")

    page.click("#stage-card-4")  # back to the 70B model, sharded: it fits again
    wait_for_result(page, "body.model === 'llama-3.1-70b' && body.tp === 4")
    assert page.is_hidden("#does-not-fit")


def test_live_engine_panel_under_servelab_serve(open_lab, gateway_with_key):
    url = gateway_with_key.url
    page = open_lab(url)  # the page and the lab API need no key
    assert page.is_visible("#live") and page.inner_text("#engine-badge") == "live engine + simulator"
    page.wait_for_function("Number(document.getElementById('live').dataset.updates || 0) >= 2", timeout=TIMEOUT_MS)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "The lab page", "max_tokens": 8},
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 200
    page.wait_for_function("/[1-9][0-9,]* requests served/.test(document.getElementById('live-note').textContent)",
                           timeout=TIMEOUT_MS)
    assert page.inner_text("#live-kv").endswith("%")  # the engine has stepped: its KV meters exist
    assert page.inner_text("#live-note").startswith("tiny_llama")
