"""The lab page's autoscaling and measured-path panels in a real browser against `servelab lab web`: for a ramp workload the plots
appear and the replicas rise and fall with the load, the decision line and the SLO-miss shares are the API's
numbers, and in Chinese no English sentence is left. Screenshots of the panel land in $SERVELAB_SCREENSHOTS
(docs/screenshots/ when updating them) or in the test's temporary folder."""
from __future__ import annotations

import json
import re

from lab_helpers import TIMEOUT_MS, api_simulate

from servelab.lab.analysis.slo_attribution import PARTS
from test_lab_languages import english_left, screenshot_dir, wait_for_advice

AUTOSCALE_TIMEOUT_MS = 4 * TIMEOUT_MS  # two simulations of ~2,000 requests each on a shared machine
RAMP = "ramp:0=0.5,300=8,600=0.5"
AUTOSCALING_WHY = '#decisions li[data-decision="GPU autoscaling"] .why'


def run_autoscaling(page) -> dict:
    page.select_option("#as-schedule", RAMP)
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
    assert legend.count() == len(PARTS)
    for i, part in enumerate(PARTS):
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


def test_the_advisor_cites_the_autoscaled_comparison_for_the_panels_ramp(open_lab, lab_web):
    page = open_lab(lab_web.url, "/lab?lang=en")
    wait_for_advice(page)
    assert not page.inner_text(AUTOSCALING_WHY).startswith("simulated")  # the rule of thumb on decode capacity
    assert page.locator("#advice-scope").is_hidden()
    run_autoscaling(page)
    # the panel's run asks the advisor again with its settings: `lab advise --autoscale keda --rate-schedule ...`
    page.wait_for_function("document.getElementById('advice').dataset.status === 'ready' &&"
                           " JSON.parse(document.getElementById('advice').dataset.body).autoscale === 'keda'",
                           timeout=AUTOSCALE_TIMEOUT_MS)
    body = json.loads(page.get_attribute("#advice", "data-body"))
    assert {k: body[k] for k in ("rate_schedule", "autoscale", "min_replicas", "max_replicas", "startup_s",
                                 "cooldown_s", "interval_s")} == {
        "rate_schedule": RAMP, "autoscale": "keda", "min_replicas": 1, "max_replicas": 4, "startup_s": 60,
        "cooldown_s": 60, "interval_s": 15}
    answer = api_simulate(lab_web.url, body, "advise")
    (expected,) = [d for d in answer["decisions"] if d["decision"] == "GPU autoscaling"]
    shown = page.inner_text(AUTOSCALING_WHY)
    assert shown == expected["why"]
    # the simulated comparison's figures: replicas kept, GPU-hours against a fixed 4 replicas, both attainments
    figures = re.fullmatch(r"simulated, the autoscaler kept (\d+) to (\d+) replicas serving; ([\d.]+) GPU-hours "
                           r"against ([\d.]+) for a fixed 4 replicas; it saves [^;]*; ([\d.]+)% of requests "
                           r"meet the targets \(fixed: ([\d.]+)%\).*", shown)
    assert figures, shown
    assert 1 <= int(figures[1]) <= int(figures[2]) <= 4 and float(figures[3]) < float(figures[4])
    scope = page.inner_text("#advice-scope")
    assert page.inner_text("#as-schedule option:checked") in scope and "up to 4 replicas" in scope

    page.click("#lang-zh")
    page.wait_for_function("document.documentElement.lang === 'zh-CN'")
    shown_zh = page.inner_text(AUTOSCALING_WHY)
    assert f"{figures[3]} GPU 小时" in shown_zh and f"{figures[1]} 到 {figures[2]} 个" in shown_zh, shown_zh
    page.click("details.advanced summary")
    assert english_left(page) == []

    page.click("#advice-constant")  # back to the page's constant rate: the rule of thumb again
    page.wait_for_function("document.getElementById('advice').dataset.status === 'ready' &&"
                           " !('autoscale' in JSON.parse(document.getElementById('advice').dataset.body))",
                           timeout=AUTOSCALE_TIMEOUT_MS)
    assert "GPU 小时" not in page.inner_text(AUTOSCALING_WHY)
    assert page.locator("#advice-scope").is_hidden()
