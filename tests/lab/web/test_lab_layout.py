"""The live process layout under `servelab serve -tp 2` (tiny model): /lab/api/live/layout lists the API server,
the engine core (colocated) and its 2 tensor-parallel ranks with the pids the engine logged, and the lab page
draws one box per rank, and its "draw this server" button gives the architecture diagram that shape; a
`servelab lab web` page (no engine) has neither."""
from __future__ import annotations

import re

import httpx
import pytest
from servelab.testing.server import TINY_ENGINE_FLAGS, children

from lab_helpers import TIMEOUT_MS


@pytest.fixture(scope="module")
def tp2_server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "-tp", "2")
    yield server
    server.stop()


def logged_rank_pids(server) -> list[int]:
    match = re.search(r"tensor-parallel ranks ready: (.*)", server.log())
    assert match, server.log()
    return [int(pid) for pid in re.findall(r"rank \d+ pid (\d+)", match.group(1))]


def test_layout_json_names_every_process(tp2_server):
    layout = httpx.get(f"{tp2_server.url}/lab/api/live/layout", timeout=10).json()
    assert layout["api_server_pid"] == tp2_server.proc.pid
    assert (layout["tensor_parallel_size"], layout["data_parallel_size"]) == (2, 1)
    [engine] = layout["engines"]
    assert engine["role"] == "colocated" and engine["alive"] is True and engine["num_kv_handoffs"] == 0
    assert engine["pid"] in children(tp2_server.proc.pid)
    assert [r["rank"] for r in engine["ranks"]] == [0, 1]
    assert [r["pid"] for r in engine["ranks"]] == logged_rank_pids(tp2_server)
    assert all(r["pid"] in children(engine["pid"]) for r in engine["ranks"])
    assert (engine["quantization"], engine["kv_cache_dtype"]) == ("none", "auto")  # --dtype float32 asked for
    assert "--dtype float32" in engine["quantization_reason"]


def test_page_draws_one_box_per_rank(tp2_server, open_lab):
    page = open_lab(tp2_server.url)
    page.wait_for_function("() => Number(document.getElementById('live-layout').dataset.updates || 0) >= 1",
                           timeout=TIMEOUT_MS)
    assert page.get_attribute("#live-layout", "data-tp") == "2"
    ranks = page.locator("#live-layout .layout-engine .layout-rank")
    assert ranks.count() == 2
    assert [int(pid) for pid in ranks.evaluate_all("els => els.map(e => e.dataset.pid)")] == \
        logged_rank_pids(tp2_server)
    assert "TP rank 1" in ranks.nth(1).inner_text()
    assert "prefill + decode" in page.locator("#live-layout .layout-engine").inner_text()
    assert page.get_attribute("#live-layout .layout-quantization", "data-mode") == "none"
    assert "weights none, KV cache auto" in page.locator("#live-layout .layout-quantization").inner_text()


def test_lab_web_has_no_layout(lab_web):
    assert httpx.get(f"{lab_web.url}/lab/api/live/layout", timeout=10).status_code == 404


def test_draw_this_server_puts_its_process_layout_in_the_diagram(tp2_server, open_lab):
    page = open_lab(tp2_server.url)
    page.wait_for_function("() => Number(document.getElementById('live-layout').dataset.updates || 0) >= 1",
                           timeout=TIMEOUT_MS)
    assert page.get_attribute("#architecture", "data-stage") != "4"
    assert page.is_hidden("#diagram-live-note")
    page.click("#diagram-live")
    page.wait_for_function("() => document.getElementById('architecture').dataset.live === 'true'",
                           timeout=TIMEOUT_MS)
    assert page.get_attribute("#architecture", "data-stage") == "4"
    assert (page.input_value("#in-tp"), page.input_value("#in-gpus")) == ("2", "2")
    assert page.is_checked("#sw-tp") and not page.is_checked("#sw-pd")
    assert page.inner_text("#diagram-live-note") == (
        "Drawn from this server's processes: 1 engine core, each over TP 2 ranks (see the live panel's process layout).")
    assert page.locator("#box-shards").get_attribute("data-state") == "active"
    page.click("label.switch:has(#sw-tp)")  # the inputs leave the server's shape: the note goes
    page.wait_for_function("() => document.getElementById('architecture').dataset.live === 'false'",
                           timeout=TIMEOUT_MS)
    assert page.is_hidden("#diagram-live-note")
