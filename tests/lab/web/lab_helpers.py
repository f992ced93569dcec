"""Helpers the lab page's browser tests share: waiting for the page's own simulation, and asking the API the
same question while the page's advisor may hold the lab."""
from __future__ import annotations

import json
import re
import time

import httpx

TIMEOUT_MS = 60_000


def wait_for_result(page, predicate: str) -> dict:
    """Waits until the meters show a finished simulation whose inputs (`body`) satisfy the JS predicate."""
    page.wait_for_function(
        "() => { const m = document.getElementById('meters');"
        " if (m.dataset.status !== 'ready') return false;"
        f" const body = JSON.parse(m.dataset.body); return {predicate}; }}", timeout=TIMEOUT_MS)
    return json.loads(page.get_attribute("#meters", "data-body"))


def api_simulate(base_url: str, body: dict, command: str = "simulate") -> dict:
    """The API's answer for the page's inputs; waits its turn while the page's own advisor run holds the lab."""
    for _ in range(240):
        response = httpx.post(f"{base_url}/lab/api/{command}", json=body, timeout=60)
        if response.status_code != 429:
            break
        time.sleep(0.25)
    assert response.status_code == 200, response.text
    return response.json()


# The English a Chinese page keeps: technical terms as engineers write them in Chinese, names of papers, products
# and units. Words with a digit, "_", "/" or "." (numbers, identifiers, paths, model and GPU names) are not prose.
TECHNICAL_TERMS = frozenset("""
    kv cache batch batching continuous static paged attention pagedattention prefill decode chunked ttft tpot e2e
    gpu gpus cpu throughput token tokens tensor parallel tp step slot block pool all-reduce ring dense nvlink pcie
    workload prompt worker goodput slo flop flops llm api json key value rank kernel activation batcher in-flight
    pipeline head grouped-query gamma profile random sharegpt-like prefix-shared local-cpu advisor
    vllm orca sarathi-serve megatron-lm tensorrt-llm triton nvidia distserve splitwise osdi sosp isca kwon xgrammar mlsys
    keda hpa kubernetes dynamo aiconfigurator vidur vidur-search mlsys llm-d sglang mooncake
    servelab lab serving benchmark en ms gib mib tb tok req torch curl authorization bearer
""".split())
WORD = re.compile(r"-*[A-Za-z][A-Za-z0-9_\-./]*")


def english_words(text: str, names: frozenset[str] = frozenset()) -> list[str]:
    """The words of `text` that are English prose rather than technical terms or `names` (lower case)."""
    allowed = TECHNICAL_TERMS | names
    out = []
    for word in WORD.findall(text):
        word = word.rstrip(".-/")  # a flag keeps its leading dashes: not prose
        lower = word.lower()
        if len(word) < 2 or re.search(r"[\d_/.]", word) or word.startswith("-") or lower in allowed:
            continue
        if "-" in lower and all(part in allowed for part in lower.split("-")):
            continue
        out.append(word)
    return out


def catalog_names() -> frozenset[str]:
    """The words of the catalog's model and GPU names (Llama, Instinct, SXM...) and its calibration profiles'
    names (identifiers such as `public`, shown as they are in every language)."""
    from servelab.lab.catalog import get_device, get_model, gpu_ids, model_ids
    from servelab.lab.catalog.calibration import calibration_names
    names = ([get_model(m).name for m in model_ids()] + [get_device(g).name for g in gpu_ids()]
             + list(calibration_names()))
    return frozenset(word.lower() for name in names for word in WORD.findall(name))
