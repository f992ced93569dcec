"""The lab page's autoscaling and measured-path panels in a real browser against `servelab lab web`: for a ramp workload the plots
appear and the replicas rise and fall with the load, the decision line and the SLO-miss shares are the API's
numbers, and in Chinese no English sentence is left. Screenshots of the panel land in $SERVELAB_SCREENSHOTS
(docs/screenshots/ when updating them) or in the test's temporary folder."""
from __future__ import annotations

import json
import re

from lab_helpers import TIMEOUT_MS, api_simulate
from test_lab_languages import english_left, screenshot_dir

AUTOSCALE_TIMEOUT_MS = 4 * TIMEOUT_MS  # two simulations of ~2,000 requests each on a shared machine


def run_autoscaling(page) -> dict:
    page.select_option("#as-schedule", "ramp:0=0.5,300=8,600=0.5")
    page.select_option("#as-policy", "keda")
    page.fill("#as-max", "4")
    page.click("#as-run")
    page.wait_for_function("document.getElementById('autoscale').dataset.status === 'ready'",
                           timeout=AUTOSCALE_TIMEOUT_MS)
    return json.loads(page.get_attribute("#autoscale", "data-replicas"))


def test_autoscaling_plots_follow_a_ramp_and_read_in_both_languages(open_lab, lab_web, tmp_path):
    page = open_lab(lab_web.url, "/lab?lang=en")
    page.set_viewport_size({"width": 1280, "height": 900})
    # the measured path: the shipped `bench stages` runs, one row per stage; no "measure here" without a model
    page.wait_for_function("document.getElementById('measured').dataset.status === 'ready'", timeout=TIMEOUT_MS)
    assert page.locator("#ms-sets .ms-set").first.locator("tr[data-schedule]").count() == 5
    assert page.locator("#ms-actions").is_hidden()
    body = page.evaluate("window.LabPage.body()")
    replicas = run_autoscaling(page)
    peak = replicas.index(max(replicas))
    assert replicas[0] == 1 and max(replicas) > 1, replicas
    assert 0 < peak and replicas[-1] < max(replicas), replicas  # up with the ramp, back down after it
    assert page.locator("#as-plots .as-plot").count() == 4
    assert page.locator("#as-plots polyline").count() == 5  # replicas and load share the first plot
    assert "GPU-hours" in page.inner_text("#as-decision")

    # the panel shows the API's own answer for the same inputs
    request = {**body, "rate_schedule": "ramp:0=0.5,300=8,600=0.5", "autoscale": "keda", "min_replicas": 1,
               "max_replicas": 4, "startup_s": 60, "cooldown_s": 60, "interval_s": 15,
               "slo_attribution": True}
    answer = api_simulate(lab_web.url, request)
    assert answer["autoscaling"]["timeline"]["mixed"]["num_ready"] == replicas
    legend = page.locator("#as-misses-legend li")
    assert legend.count() == 5
    for i, part in enumerate(("queued", "prefill", "kv_transfer", "decode_interference", "decode")):
        assert page.get_attribute(f"#as-misses-legend li:nth-child({i + 1})", "data-part") == part
        shown = float(re.search(r"([\d.]+)%", legend.nth(i).inner_text())[1])
        assert abs(shown - answer["slo_misses"]["share"][part] * 100) <= 0.5

    shots = screenshot_dir(tmp_path)
    page.add_style_tag(content="header.top { position: static; }")  # not over the panels' screenshots
    page.locator("#autoscale").screenshot(path=str(shots / "lab-autoscale-en.png"))
    page.locator("#measured").screenshot(path=str(shots / "lab-measured-en.png"))
    page.click("#lang-zh")
    page.wait_for_function("document.documentElement.lang === 'zh-CN'")
    page.wait_for_function("document.getElementById('as-decision').textContent.includes('GPU 小时')")
    page.click("details.advanced summary")
    assert english_left(page) == []
    page.locator("#autoscale").screenshot(path=str(shots / "lab-autoscale-zh.png"))
    page.locator("#measured").screenshot(path=str(shots / "lab-measured-zh.png"))
