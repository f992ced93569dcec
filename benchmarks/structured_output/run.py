"""What constrained decoding costs: the grammar mask per decode step at batch 1 and 64, and a served burst of
the default model with and without a JSON schema.

    python benchmarks/structured_output/run.py                 # both parts, writes result.json beside this file
    python benchmarks/structured_output/run.py --skip-served   # the mask cost only (seconds)

Mask cost: StructuredOutputManager fills the step's bitmask for B requests of one JSON schema part-way through
their output (llguidance, SmolLM2's 49,152-token vocabulary), the sampler applies it to (B, 49,152) fp32 logits,
and the matchers take the sampled tokens; the median over 40 steps of each part, in CPU ms (all threads) and wall
ms. In the engine the fill runs on a thread beside the forward pass; here it runs alone, to be timed.
Served burst: `servelab serve` (default model), 32 chat requests at once, 64 output tokens each (ignore_eos
unconstrained; constrained by a schema whose shortest answer is longer than 64 tokens), alternating runs,
best of each; output tokens/s and the server's CPU seconds (API process + engine core) per output token."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from servelab.core.plan import SampledToken, ScheduledRequest, StepPlan, StepResult
from servelab.core.request import Request
from servelab.model.loader import resolve_model_path
from servelab.model.sampler import SamplingRow, shape_logits_
from servelab.model.tokenizer import Tokenizer
from servelab.sampling_params import SamplingParams, StructuredOutputsParams
from servelab.structured_output import StructuredOutputManager, ll_tokenizer

HERE = Path(__file__).parent
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 150},
                         "tags": {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 12}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
# At least 40 two-token items: longer than the burst's 64 output tokens, so both runs make exactly 64.
LONG_SCHEMA = {"type": "array", "minItems": 40, "maxItems": 40, "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}
TICKS = os.sysconf("SC_CLK_TCK")


def mask_cost(batch_size: int, num_steps: int = 40, seed: int = 0) -> dict:
    folder = resolve_model_path(None)
    tokenizer = Tokenizer.from_pretrained(folder)
    vocab_size = 49152
    manager = StructuredOutputManager(lambda: ll_tokenizer(tokenizer.to_json(), vocab_size, tokenizer.eos_token_ids),
                                      vocab_size)
    grammar = StructuredOutputsParams("json", json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, structured_outputs=grammar)
    rng = np.random.default_rng(seed)
    serial = iter(range(10 ** 9))

    def new_request() -> Request:
        request = Request(f"r{next(serial)}", [1, 2, 3], params, 512)
        manager.add_request(request)
        return request

    requests = [new_request() for _ in range(batch_size)]
    parts = ("fill_bitmask", "apply_in_sampler", "accept_tokens")
    wall: dict[str, list[float]] = {name: [] for name in parts}
    cpu: dict[str, list[float]] = {name: [] for name in parts}
    rows = [SamplingRow(params, [], []) for _ in range(batch_size)]
    for step in range(num_steps + 5):  # the first steps warm up (compile, first masks)
        plan = StepPlan([ScheduledRequest(r.request_id, [0], 3, [0], True, params) for r in requests])
        logits = torch.from_numpy(rng.standard_normal((batch_size, vocab_size), dtype=np.float32))
        clocks = [(time.perf_counter(), time.process_time())]
        manager.fill_bitmask(plan, overlap=False)
        clocks.append((time.perf_counter(), time.process_time()))
        shape_logits_(logits, rows, torch.from_numpy(plan.grammar_bitmask))
        clocks.append((time.perf_counter(), time.process_time()))
        tokens = logits.argmax(dim=-1).tolist()  # an allowed token (the mask pushed the others far down)
        result = StepResult({r.request_id: SampledToken(t) for r, t in zip(requests, tokens)})
        clocks.append((time.perf_counter(), time.process_time()))
        done = set(manager.accept_tokens(plan, result))
        clocks.append((time.perf_counter(), time.process_time()))
        if step >= 5:
            for name, (a, b) in zip(parts, ((0, 1), (1, 2), (3, 4))):
                wall[name].append(clocks[b][0] - clocks[a][0])
                cpu[name].append(clocks[b][1] - clocks[a][1])
        for i, request in enumerate(requests):
            request.output_token_ids.append(tokens[i])
            if request.request_id in done:  # a finished answer: a new request takes its row
                manager.remove(request.request_id)
                requests[i] = new_request()
    manager.shutdown()

    def medians(times: dict[str, list[float]]) -> dict[str, float]:
        out = {name: round(statistics.median(values) * 1e3, 3) for name, values in times.items()}
        out["total"] = round(sum(out.values()), 3)
        return out

    # CPU time (all threads) is what a busy machine inflates least; wall time is what a step waits
    return {"batch_size": batch_size, "median_cpu_ms": medians(cpu), "median_wall_ms": medians(wall)}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def server_cpu(pid: int) -> float:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return sum(cpu_seconds(int(p)) for p in [pid, *children])


async def burst(url: str, num_requests: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    body = {"messages": [{"role": "user", "content": "List forty digits."}], "max_tokens": max_tokens,
            "temperature": 0}
    body.update({"response_format": {"type": "json_schema", "json_schema": {"name": "digits", "schema": LONG_SCHEMA}}}
                if constrained else {"ignore_eos": True})
    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        responses = await asyncio.gather(*(http.post(f"{url}/v1/chat/completions", json=body)
                                           for _ in range(num_requests)))
        elapsed = time.perf_counter() - start
    for response in responses:
        response.raise_for_status()
    return elapsed, sum(r.json()["usage"]["completion_tokens"] for r in responses)


def served(num_requests: int, max_tokens: int, rounds: int, port: int = 8765) -> dict:
    command = [sys.executable, "-m", "servelab.entrypoints.cli", "serve", "--port", str(port), "--num-threads", "2",
               "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        asyncio.run(burst(url, 4, 8, True))  # warm up: the grammar compiles, the kernels are built
        runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
        for _ in range(rounds):
            for name in runs:
                cpu_before = server_cpu(proc.pid)
                elapsed, num_tokens = asyncio.run(burst(url, num_requests, max_tokens, name == "json_schema"))
                cpu = server_cpu(proc.pid) - cpu_before
                runs[name].append({"seconds": round(elapsed, 3), "output_tokens": num_tokens,
                                   "tokens_per_s": round(num_tokens / elapsed, 1),
                                   "server_cpu_ms_per_token": round(cpu / num_tokens * 1e3, 3)})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    best = {name: max(r, key=lambda x: x["tokens_per_s"]) for name, r in runs.items()}
    ratio = best["json_schema"]["tokens_per_s"] / best["unconstrained"]["tokens_per_s"]
    return {"num_requests": num_requests, "max_tokens": max_tokens, "runs": runs, "best": best,
            "json_schema_throughput_vs_unconstrained": round(ratio, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=HERE / "result.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"mask_cost": [mask_cost(b) for b in (1, 64)]}
    print(json.dumps(result, indent=1))
    if not args.skip_served:
        result["served_burst"] = served(args.num_requests, args.max_tokens, args.rounds)
        print(json.dumps(result["served_burst"]["best"], indent=1),
              result["served_burst"]["json_schema_throughput_vs_unconstrained"])
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
