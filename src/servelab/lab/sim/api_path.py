"""What a benchmark client sees: the engine's request timestamps plus the work outside the engine's steps.

Three terms, all off the GPU's path, so they move timestamps without slowing any step:
- the API server's own work per request (HTTP, tokenization, the first chunk before the first token;
  detokenization and the closing chunk after the last), from the efficiency's api_*_overhead_s;
- multi-step scheduling (vLLM's --num-scheduler-steps N): a request arriving while a block of N decode
  steps runs waits for the block to end. The simulator already makes it wait for the step in flight,
  so the extra wait is the rest of the block: on average (N - 1) / 2 decode steps, priced at the
  request's own time per output token;
- a disaggregated deployment whose proxy streams the answer from the decode instance
  (first_token_from_decode): the client sees the first token when the decode instance emits it, after
  the KV handoff and the decode instance's first step, and every later token one step later.
"""
from __future__ import annotations

from servelab.core.request import Request
from servelab.lab.sim.deployment import Deployment
from servelab.metrics.request_stats import RequestTiming


def client_timings(deployment: Deployment, requests: list[Request]) -> list[RequestTiming]:
    e, steps = deployment.efficiency, deployment.num_scheduler_steps
    via_decode = deployment.first_token_from_decode
    if not e.api_ttft_overhead_s and not e.api_final_overhead_s and steps == 1 and not via_decode:
        return [RequestTiming(r.num_prompt_tokens, r.num_output_tokens, r.arrival_time, r.times.first_token,
                              r.times.finished, r.times.token_times, r.times.first_scheduled) for r in requests]
    timings = []
    for r in requests:
        t = r.times
        before = e.api_ttft_overhead_s
        if via_decode and len(t.token_times) > 1:  # the second token is the decode instance's first step
            before += t.token_times[1] - t.token_times[0]
        if steps > 1 and r.num_output_tokens > 1:
            before += (steps - 1) / 2 * (t.finished - t.first_token) / (r.num_output_tokens - 1)
        after = before + e.api_final_overhead_s
        token_times = [x + before for x in t.token_times[:-1]] + [t.token_times[-1] + after] if t.token_times else ()
        timings.append(RequestTiming(r.num_prompt_tokens, r.num_output_tokens, r.arrival_time, t.first_token + before,
                                     t.finished + after, token_times, t.first_scheduled))
    return timings
