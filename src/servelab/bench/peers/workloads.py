"""The seeded requests every peer of `servelab bench peers` gets: burst, the same at Poisson arrivals, offline."""
from __future__ import annotations

import dataclasses

from servelab.bench.datasets import BenchRequest, build_requests
from servelab.workload import WorkloadConfig, generate_workload

POISSON_RATE = 2.0
DECODE_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class Workloads:
    burst: list[BenchRequest]
    poisson: list[BenchRequest]  # burst's requests, arriving at POISSON_RATE
    offline: list[BenchRequest]
    decode_tokens: int
    labels: dict[str, str]


def build_workloads(tokenizer, num_online: int, num_offline: int, seed: int) -> Workloads:
    burst = build_requests(WorkloadConfig(num_prompts=num_online, input_len=128, output_len=64, seed=seed),
                           tokenizer, "ids")
    arrivals = generate_workload(WorkloadConfig(num_prompts=num_online, input_len=128, output_len=64,
                                                request_rate=POISSON_RATE, seed=seed))
    poisson = [dataclasses.replace(r, arrival_time=a.arrival_time) for r, a in zip(burst, arrivals)]
    # 160 +- 60% and 80 +- 60%: 64-256 in, 32-128 out.
    offline = build_requests(WorkloadConfig(num_prompts=num_offline, input_len=160, output_len=80, range_ratio=0.6,
                                            seed=seed + 1), tokenizer, "ids")
    labels = {"burst": f"burst {num_online} x (128 in, 64 out)",
              "poisson": f"Poisson {POISSON_RATE:g} req/s, same {num_online}",
              "offline": f"offline {num_offline} x (64-256 in, 32-128 out)",
              "decode": f"decode batch 1 (tg{DECODE_TOKENS})"}
    return Workloads(burst, poisson, offline, DECODE_TOKENS, labels)
