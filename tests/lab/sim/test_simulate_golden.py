"""The simulator's `--json` output is byte-identical to the recorded one on 30 deployments and workloads.

Refactors of the engine core, the scheduler, the block manager or the cost model must not move a single
byte of a simulation. A change meant to alter results regenerates the record:
    python tests/lab/sim/test_simulate_golden.py --write
"""
import contextlib
import hashlib
import io
import json
import sys
from pathlib import Path

import pytest

from servelab.entrypoints.cli import main

GOLDEN = Path(__file__).parent / "data" / "simulate_golden.json"

_W = ["--num-prompts", "120", "--input-len", "300", "--output-len", "60", "--range-ratio", "0.5"]
CONFIGS = [
    # stages 1-3 on one GPU, at several rates
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--schedule", "serial", "--request-rate", "2", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--schedule", "static", "--request-rate", "8", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--schedule", "continuous", "--request-rate", "8", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--request-rate", "inf", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--request-rate", "1", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--request-rate", "16", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "l4", "--request-rate", "4", *_W],
    ["--model", "smollm2-135m", "--gpu", "a10g", "--request-rate", "inf", *_W],
    ["--model", "qwen2.5-7b", "--gpu", "h200", "--request-rate", "12", "--dataset", "sharegpt-like", "--num-prompts", "150"],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--dataset", "sharegpt-like", "--num-prompts", "200"],
    # tensor parallelism and replicas
    ["--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "4", "--request-rate", "4", *_W],
    ["--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "8", "--request-rate", "inf", *_W],
    ["--model", "llama-3.1-70b", "--gpu", "a100-80gb", "--tp", "4", "--num-gpus", "8", "--router", "least-loaded", "--request-rate", "8", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--num-gpus", "4", "--request-rate", "32", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--num-gpus", "3", "--router", "least-loaded", "--request-rate", "20", "--burstiness", "0.5", *_W],
    ["--model", "qwen2.5-72b", "--gpu", "mi300x", "--tp", "2", "--request-rate", "6", *_W],
    ["--model", "llama-3.1-405b", "--gpu", "b200", "--tp", "8", "--request-rate", "2", *_W],
    ["--model", "mixtral-8x7b", "--gpu", "h100", "--tp", "2", "--request-rate", "8", *_W],
    # prefill/decode disaggregation
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--disaggregate", "1:1", "--request-rate", "8", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--disaggregate", "1:3", "--request-rate", "24", *_W],
    ["--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "4", "--disaggregate", "2:1", "--request-rate", "6", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--disaggregate", "2:2", "--router", "least-loaded", "--request-rate", "inf", *_W],
    # KV pressure: preemption, small blocks, small budgets, single steps
    ["--model", "llama-3.1-8b", "--gpu", "l4", "--max-num-seqs", "512", "--request-rate", "inf", "--num-prompts", "200", "--input-len", "1500", "--output-len", "400"],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--block-size", "8", "--max-num-batched-tokens", "512", "--request-rate", "10", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--block-size", "32", "--max-num-seqs", "16", "--request-rate", "inf", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--schedule", "static", "--max-num-seqs", "32", "--request-rate", "inf", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--single-step", "--request-rate", "8", *_W],
    ["--model", "llama-3.1-70b", "--gpu", "h100", "--tp", "4", "--disaggregate", "1:1", "--single-step", "--request-rate", "3", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "h100", "--dtype", "fp8", "--request-rate", "16", "--ttft-target", "200ms", "--tpot-target", "20ms", *_W],
    ["--model", "llama-3.1-8b", "--gpu", "a10g", "--schedule", "serial", "--request-rate", "0.5", "--seed", "3", *_W],
]


def simulate_bytes(flags: list[str]) -> tuple[int, bytes]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["lab", "simulate", *flags, "--json"])
    return code, out.getvalue().encode()


def record(flags: list[str]) -> dict:
    code, data = simulate_bytes(flags)
    return {"flags": flags, "exit_code": code, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_simulation_bytes_unchanged(index):
    expected = json.loads(GOLDEN.read_text())[index]
    assert expected["flags"] == CONFIGS[index]
    assert record(CONFIGS[index]) == expected


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    GOLDEN.write_text(json.dumps([record(flags) for flags in CONFIGS], indent=1) + "\n")
