"""How fast the lab page redraws after an input change, for the default workload (stage 3's preset): a real
`servelab lab web` and Debian's Chromium through Playwright. Each sample moves the request-rate slider and
times, in the page's own clock, from the input event to the meters showing the new simulation (debounce, the
API call and the drawing). The first series waits between samples until the advisor, which the page runs once
the inputs settle, has answered for the new inputs, so that no sample waits behind it; the second moves the
slider again as soon as the meters are drawn, while the page waits for the inputs to settle; the third as soon as
the advisor has started, which the new simulation waits for (the lab runs one job at a time). Each sample splits
its time into waiting to send, the API call, the drawing's JS and the paint. Written to
benchmarks/lab_page_redraw/lab_page_redraw.json.

    .venv/bin/python benchmarks/lab_page_redraw/run.py [--samples 10]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
RATE_INDICES = [3, 5]  # 2 and 4 req/s on the page's list of rates
DEFAULT_RATE_INDEX = 4  # 3 req/s
TIMEOUT_MS = 120_000
# The advice is the current inputs' (the previous one stays 'ready' but dimmed until the advisor has run).
ADVICE_CURRENT = ("document.getElementById('advice').dataset.status === 'ready' &&"
                  " !document.getElementById('recommendation').classList.contains('stale')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "servelab.entrypoints.cli", "lab", "web", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("servelab lab web did not start")


# In the page: a MutationObserver notes when the meters show a new run (the drawing's JS is done) and the frame
# after it (painted); the simulate call's resource timing splits the time into waiting to send (debounce, or an
# advisor call in flight), the API call, and drawing.
START_SAMPLE_JS = """(v) => {
  const meters = document.getElementById('meters');
  const runs = Number(meters.dataset.runs || 0);
  window.__sample = null;
  const observer = new MutationObserver(() => {
    if (meters.dataset.status !== 'ready' || Number(meters.dataset.runs) <= runs) return;
    observer.disconnect();
    const drawn = performance.now();
    requestAnimationFrame(() => setTimeout(() => { window.__sample = { drawn, painted: performance.now() }; }, 0));
  });
  observer.observe(meters, { attributes: true });
  const el = document.getElementById('in-rate');
  window.__t0 = performance.now();
  el.value = v;
  el.dispatchEvent(new Event('input', { bubbles: true }));
}"""
READ_SAMPLE_JS = """() => {
  const t0 = window.__t0, s = window.__sample;
  const calls = performance.getEntriesByType('resource')
    .filter((e) => e.name.includes('/lab/api/simulate') && e.startTime >= t0);
  const call = calls[calls.length - 1];
  return { total_ms: s.painted - t0, wait_ms: call.startTime - t0, api_ms: call.responseEnd - call.startTime,
           draw_ms: s.drawn - call.responseEnd, paint_ms: s.painted - s.drawn };
}"""


def sample(page, index: int, wait_for_advice: bool) -> dict:
    page.evaluate(START_SAMPLE_JS, index)
    page.wait_for_function("window.__sample !== null", timeout=TIMEOUT_MS)
    parts = {k: round(v, 1) for k, v in page.evaluate(READ_SAMPLE_JS).items()}
    if wait_for_advice:
        page.wait_for_function(ADVICE_CURRENT, timeout=TIMEOUT_MS)
    return parts


def sample_while_advising(page, index: int) -> dict:
    """A change to the default rate (not timed), then, once the advisor has started for it, the timed change."""
    sample(page, DEFAULT_RATE_INDEX, False)
    page.wait_for_function("document.getElementById('advice').dataset.status === 'busy'", timeout=TIMEOUT_MS)
    parts = sample(page, index, False)
    page.wait_for_function(ADVICE_CURRENT, timeout=TIMEOUT_MS)
    return parts


def summary(samples: list[dict]) -> dict:
    return {"median_ms": statistics.median(s["total_ms"] for s in samples),
            "max_ms": max(s["total_ms"] for s in samples),
            "median_parts_ms": {k: statistics.median(s[k] for s in samples) for k in samples[0] if k != "total_ms"},
            "samples": samples}


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("lab_page_redraw.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    port = free_port()
    server = start_server(port)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"http://127.0.0.1:{port}/lab?lang=en")
            page.wait_for_function("document.getElementById('meters').dataset.status === 'ready'", timeout=TIMEOUT_MS)
            page.wait_for_function(ADVICE_CURRENT, timeout=TIMEOUT_MS)
            body = json.loads(page.get_attribute("#meters", "data-body"))
            samples = [sample(page, RATE_INDICES[i % 2], True) for i in range(args.samples)]
            # the next change right after a redraw: the page is waiting for the inputs to settle before it asks
            # the advisor (a slider moved twice within half a second)
            quick = [sample(page, RATE_INDICES[i % 2], False) for i in range(args.samples)]
            page.wait_for_function(ADVICE_CURRENT, timeout=TIMEOUT_MS)
            # the next change just after the advisor has started (half a second after the last one)
            advising = [sample_while_advising(page, RATE_INDICES[i % 2]) for i in range(args.samples)]
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "workload": body, "target_ms": 300, "advisor_idle": summary(samples),
        "right_after_a_redraw": summary(quick), "while_the_advisor_runs": summary(advising),
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "samples"} if isinstance(v, dict) else v)
                      for k, v in payload.items() if k != "workload"}, indent=2))


if __name__ == "__main__":
    main()
