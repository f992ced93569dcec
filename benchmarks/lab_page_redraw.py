"""How fast the lab page redraws after an input change, for the default workload (stage 3's preset): a real
`servelab lab web` and Debian's Chromium through Playwright. Each sample moves the request-rate slider and
times, in the page's own clock, from the input event to the meters showing the new simulation (debounce, the
API call and the drawing). Between samples it waits for the advisor, which the page runs once the inputs
settle, so that no sample waits behind it. Written to benchmarks/results/lab_page_redraw.json.

    .venv/bin/python benchmarks/lab_page_redraw.py [--samples 10]
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
RATE_INDICES = [3, 5]  # 2 and 4 req/s on the page's list of rates (the default is 3 req/s)
TIMEOUT_MS = 120_000


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


def sample(page, index: int) -> float:
    runs = int(page.get_attribute("#meters", "data-runs") or 0)
    page.evaluate("""(v) => { const el = document.getElementById('in-rate'); window.__t0 = performance.now();
        el.value = v; el.dispatchEvent(new Event('input', { bubbles: true })); }""", index)
    page.wait_for_function(f"(() => {{ const m = document.getElementById('meters');"
                           f" return m.dataset.status === 'ready' && Number(m.dataset.runs) > {runs}; }})()",
                           timeout=TIMEOUT_MS)
    elapsed = page.evaluate("performance.now() - window.__t0")
    page.wait_for_function("document.getElementById('advice').dataset.status === 'ready'", timeout=TIMEOUT_MS)
    return elapsed


def main() -> None:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lab_page_redraw.json"))
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
            page.wait_for_function("document.getElementById('advice').dataset.status === 'ready'", timeout=TIMEOUT_MS)
            body = json.loads(page.get_attribute("#meters", "data-body"))
            samples = [sample(page, RATE_INDICES[i % 2]) for i in range(args.samples)]
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "workload": body, "samples_ms": [round(s, 1) for s in samples],
        "median_ms": statistics.median(samples), "max_ms": max(samples), "target_ms": 300,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps({k: v for k, v in payload.items() if k != "workload"}, indent=2))


if __name__ == "__main__":
    main()
