"""The lab page's servers and browser: a real `servelab lab web` on 127.0.0.1, a real `servelab serve` of the
tiny model with an API key, and Debian's Chromium driven by Playwright (never a downloaded browser)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from servelab.testing.server import API_KEY, TINY_ENGINE_FLAGS, ServerProcess, free_port, servelab_command

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
STARTUP_TIMEOUT_S = 60.0


class LabWebProcess(ServerProcess):
    """`servelab lab web` on a free port: a ServerProcess (readiness on /health, log, stop) running another command.
    env adds variables (SERVELAB_CACHE_DIR: where its CPU profile is); cwd holds the results folder it lists."""

    def __init__(self, log_path: Path, env: dict | None = None, cwd: Path | None = None) -> None:
        # not the parent's constructor: that one starts `servelab serve`
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [*servelab_command(), "lab", "web", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, cwd=cwd)


@pytest.fixture(scope="session")
def lab_web(tmp_path_factory) -> LabWebProcess:
    server = LabWebProcess(tmp_path_factory.mktemp("lab_web") / "lab-web.log")
    try:
        yield server.wait_ready(timeout=STARTUP_TIMEOUT_S)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def gateway_with_key(start_server, tiny_llama_dir):
    """`servelab serve` of the tiny model that requires API_KEY on /v1, with fast metrics snapshots."""
    return start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--api-key", API_KEY, "--metrics-interval", "0.2")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A Chromium context with a fresh profile. Module-scoped: Playwright's sync API holds an event loop while it
    is open, which other test modules' asyncio.run() must not meet."""
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run `make chromium` (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def open_lab(browser):
    """open_lab(base_url, path="/lab") -> a page showing the lab (with its first simulation rendered) or, for
    another path, that page once loaded. Fails the test on any script error or console error (a string missing
    from a language file is one), except the 429s the page waits out while the test's own API call runs."""
    from lab_helpers import wait_for_result

    pages, errors = [], []

    def open_page(base_url: str, path: str = "/lab"):
        page = browser.new_page()
        page.on("pageerror", lambda err: errors.append(f"pageerror: {err}"))
        page.on("console", lambda msg: errors.append(f"console: {msg.text}")
                if msg.type == "error" and "status of 429" not in msg.text else None)
        pages.append(page)
        page.goto(f"{base_url}{path}")
        if path.split("?")[0] == "/lab":
            wait_for_result(page, "true")
        return page

    yield open_page
    for page in pages:
        page.close()
    assert errors == []
