"""The lab on `servelab serve` (a real server of the tiny model, started with --api-key): the page and its API
answer without the key, /v1 still requires it, and a simulation gives the same bytes as `servelab lab web`."""
from __future__ import annotations

import httpx

from servelab.testing.server import API_KEY

SMALL = {"model": "llama-3.1-8b", "gpu": "h100", "num_prompts": 40, "request_rate": 4, "ttft_target_ms": 300}


def test_lab_needs_no_key_while_v1_does(gateway_with_key, lab_web):
    url = gateway_with_key.url
    page = httpx.get(f"{url}/lab", timeout=10)
    assert page.status_code == 200 and "servelab lab" in page.text
    catalog = httpx.get(f"{url}/lab/api/catalog", timeout=10)
    assert catalog.status_code == 200
    assert catalog.json()["live_engine"] == {"metrics_stream": "/v1/metrics/stream", "needs_api_key": False,
                                             "layout": "/lab/api/live/layout"}

    simulated = httpx.post(f"{url}/lab/api/simulate", json=SMALL, timeout=60)
    assert simulated.status_code == 200, simulated.text
    assert simulated.content == httpx.post(f"{lab_web.url}/lab/api/simulate", json=SMALL, timeout=60).content
    wrong_key = httpx.post(f"{url}/lab/api/simulate", json=SMALL, timeout=60,
                           headers={"Authorization": "Bearer not-the-key"})
    assert wrong_key.status_code == 200 and wrong_key.content == simulated.content

    bad = httpx.post(f"{url}/lab/api/simulate", json={"tp": "four"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tp"

    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
    no_key = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert models.status_code == 200
