"""The evolution path as five presets of the lab page's inputs (the API's JSON fields). One model on one
GPU type throughout, so each step's gain is the step's own: Llama-3.1-70B's 131 GiB of bf16 weights fit a
180 GB B200 with little room left for KV, which is what makes sharding pay at step 4."""
from __future__ import annotations

_WORKLOAD = dict(model="llama-3.1-70b", gpu="b200", dataset="random", input_len=1024, output_len=256,
                 range_ratio=0.5, request_rate=3, num_prompts=400, burstiness=1.0, seed=0,
                 ttft_target_ms=500, tpot_target_ms=None)
_ONE_GPU = dict(num_gpus=1, tp=1, disaggregate=None)

_CONTINUOUS = dict(schedule="continuous", max_num_seqs=256)
# (title, summary, what to watch, inputs), stage 1 first
_STAGES = [
    ("One request at a time",
     "The GPU serves a single request from prompt to last token; everyone else queues.",
     "Decode capacity is a sliver of the demand, so TTFT grows with every arrival.",
     {**_WORKLOAD, **_ONE_GPU, "schedule": "serial", "max_num_seqs": 1}),
    ("Static batching with a KV cache",
     "Up to 64 requests decode together, each with its own contiguous KV reservation.",
     "Throughput keeps up, but a new request waits for the whole batch to drain: TTFT is seconds.",
     {**_WORKLOAD, **_ONE_GPU, "schedule": "static", "max_num_seqs": 64}),
    ("Continuous batching + paged attention",
     "Requests join and leave at every step; KV lives in 16-token blocks allocated on demand.",
     "TTFT drops to a few hundred ms. The weights fill 73% of the GPU, so KV room is tight.",
     {**_WORKLOAD, **_ONE_GPU, **_CONTINUOUS}),
    ("Tensor-parallel sharding",
     "Each layer is split over 4 GPUs joined by NVLink: a quarter of the weights on each.",
     "Weights per GPU fall from 131 to 33 GiB, the KV pool grows, TPOT falls about 4x.",
     {**_WORKLOAD, **_CONTINUOUS, "num_gpus": 4, "tp": 4, "disaggregate": None}),
    # 200 requests: the advisor's search at this scale simulates ~60 shapes, ~10 s here
    ("Prefill/decode disaggregation",
     "At scale with long prompts, 2 prefill and 2 decode instances (TP 4 each) hand KV over.",
     "Long prefills no longer stall decode steps: p99 TPOT meets the 10 ms target.",
     {**_WORKLOAD, **_CONTINUOUS, "input_len": 4096, "output_len": 512, "request_rate": 8, "num_prompts": 200,
      "ttft_target_ms": 1000, "tpot_target_ms": 10, "num_gpus": 16, "tp": 4, "disaggregate": "2:2"}),
]
PRESETS = [{"stage": n, "title": title, "summary": summary, "watch": watch, "inputs": inputs}
           for n, (title, summary, watch, inputs) in enumerate(_STAGES, start=1)]
DEFAULT_STAGE = 3
DEFAULT_INPUTS = PRESETS[DEFAULT_STAGE - 1]["inputs"]
