"""The evolution path as six presets of the lab page's inputs (the API's JSON fields). One model on one
GPU type throughout, so each step's gain is the step's own: Llama-3.1-70B's 131 GiB of bf16 weights fit a
180 GB B200 with little room left for KV, which is what makes sharding pay at step 4. Step 6 routes data-parallel
replicas by their cached prefixes, on a workload whose requests share long prefixes.

The cards' wording (title, summary, what to watch) is in static/i18n/<lang>.json under `stage.<n>.*`."""
from __future__ import annotations

_WORKLOAD = dict(model="llama-3.1-70b", gpu="b200", dataset="random", input_len=1024, output_len=256,
                 range_ratio=0.5, request_rate=3, num_prompts=400, burstiness=1.0, seed=0,
                 ttft_target_ms=500, tpot_target_ms=None)
# no speculative decoding on the evolution path (the page sends both fields, null when its switch is off)
_NO_SPECULATION = dict(speculative_config=None, spec_acceptance_rate=None)
# one router and no shared prefixes until step 6 (the page sends these fields too)
_NO_PREFIX_ROUTING = dict(router="round-robin", prefix_len=None, num_prefixes=None)
_WORKLOAD = {**_WORKLOAD, **_NO_SPECULATION, **_NO_PREFIX_ROUTING}
_ONE_GPU = dict(num_gpus=1, tp=1, disaggregate=None)
_CONTINUOUS = dict(schedule="continuous", max_num_seqs=256)

# stage 1 first
_STAGES = [
    # one request at a time
    {**_WORKLOAD, **_ONE_GPU, "schedule": "serial", "max_num_seqs": 1},
    # static batches of up to 64, each request with its own contiguous KV reservation
    {**_WORKLOAD, **_ONE_GPU, "schedule": "static", "max_num_seqs": 64},
    # continuous batching + paged attention
    {**_WORKLOAD, **_ONE_GPU, **_CONTINUOUS},
    # each layer split over 4 GPUs joined by NVLink
    {**_WORKLOAD, **_CONTINUOUS, "num_gpus": 4, "tp": 4, "disaggregate": None},
    # at scale with long prompts: 2 prefill and 2 decode instances of TP 4. 200 requests: the advisor's search at
    # this scale simulates ~60 shapes, ~10 s here
    {**_WORKLOAD, **_CONTINUOUS, "input_len": 4096, "output_len": 512, "request_rate": 8, "num_prompts": 200,
     "ttft_target_ms": 1000, "tpot_target_ms": 10, "num_gpus": 16, "tp": 4, "disaggregate": "2:2"},
    # 4 replicas of step 4's TP-4 instance behind the prefix-aware router, on chat-like traffic: 64 prefixes
    # (system prompts, conversation histories) of 4,096 tokens, each request one of them + its own 128 tokens.
    # Against least-loaded routing on the same inputs: prefix hit rate 47% -> 73%, median TTFT 199 -> 34 ms
    # (tests/lab/web/test_lab_presets.py). 400 requests of ~4.4 k tokens: ~3 s to simulate, within the advisor's
    # 2 M-token room
    {**_WORKLOAD, **_CONTINUOUS, "dataset": "prefix-shared", "prefix_len": 4096, "num_prefixes": 64,
     "input_len": 128, "output_len": 128, "request_rate": 16, "num_prompts": 400, "num_gpus": 16, "tp": 4,
     "disaggregate": None, "router": "prefix"},
]
PRESETS = [{"stage": n, "inputs": inputs} for n, inputs in enumerate(_STAGES, start=1)]
DEFAULT_STAGE = 3
DEFAULT_INPUTS = PRESETS[DEFAULT_STAGE - 1]["inputs"]
