"""`servelab serve -dp 2 --router prefix` (tiny model, real HTTP on 127.0.0.1): a request goes to the engine core
its prompt's prefix was sent to, so a shared prefix is computed once and hit there, block for block; with
the least-loaded router the same requests miss on the other core. With `--disaggregate 2:1 --router prefix` the
same holds for the two prefill instances (engines 0 and 1; the decode instance, engine 2, takes every request)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from servelab.testing.server import TINY_ENGINE_FLAGS, metric_values, wait_for_metrics

BLOCK = 16
PREFIX_X = list(range(1000, 1160))  # 10 full blocks
PREFIX_Y = list(range(3000, 3160))


def prompt(prefix: list[int], tag: int) -> list[int]:
    return prefix + [5000 + tag] * 8  # a partial last block of its own


def idle(values: dict) -> bool:
    """No request running or waiting on any engine core."""
    return all(v == 0 for k, v in values.items()
               if k.startswith(("servelab:num_requests_running{", "servelab:num_requests_waiting{")))


async def complete(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> None:
    response = await client.post("/v1/completions", json={"prompt": ids, "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text


def hits_per_engine(url: str) -> list[float]:
    values = metric_values(url)
    return [values[f"servelab:prefix_cache_hits_total{{engine={i}}}"] for i in (0, 1)]


def run_pattern(url: str) -> list[float]:
    """X and Y at once (one core each: the second sees the first's load), then X and Y again one at a time."""
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await asyncio.gather(complete(client, prompt(PREFIX_X, 1), 24), complete(client, prompt(PREFIX_Y, 2), 24))
            wait_for_metrics(url, idle)
            await complete(client, prompt(PREFIX_X, 3), 2)
            wait_for_metrics(url, idle)
            await complete(client, prompt(PREFIX_Y, 4), 2)
    before = hits_per_engine(url)
    asyncio.run(go())
    return [a - b for a, b in zip(hits_per_engine(url), before)]


@pytest.mark.parametrize("router,layout", [("prefix", ("-dp", "2")), ("least-loaded", ("-dp", "2")),
                                           ("prefix", ("--disaggregate", "2:1"))],
                         ids=["prefix", "least-loaded", "prefix-disaggregated"])
def test_shared_prefixes_hit_on_the_core_they_were_sent_to(start_server, tiny_llama_dir, router, layout):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, *layout, "--router", router)
    try:
        hits = run_pattern(server.url)
    finally:
        server.stop()
    if router == "prefix":  # each second request finds its prefix's 10 blocks on the core that computed them
        assert sorted(hits) == [10 * BLOCK, 10 * BLOCK]
    else:  # least-loaded sends both idle-time requests to core 0: only the prefix computed there hits
        assert sorted(hits) == [0, 10 * BLOCK]
