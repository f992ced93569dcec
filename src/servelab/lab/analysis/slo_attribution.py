"""Where the time of the requests that miss a target went, counted against the metric each one missed.

A request that misses the TTFT target contributes its time to the first token, split into
  queued          arrival -> first scheduled
  prefill_wait    first scheduled -> first token, less its own prefill: waiting behind other requests'
                  prefills and chunks, and the decode steps its chunks shared
  prefill         its own prefill: the cost model's one-step price of its prompt alone (at most the time the
                  prefill phase took)
A request that misses the TPOT target contributes its time after the first token, split into
  kv_transfer     the prompt's KV crossing from a prefill to a decode instance (P/D; servelab streams the first
                  token from the prefill instance, so the transfer delays the second token, not the first)
  decode_interference  the extra time of its decode steps that also ran others' prefill chunks: each such step's
                  duration less what the cost model gives for its decode tokens alone
  decode_batch    the rest beyond decoding alone: sharing each step with the other running decodes, and waiting
                  again after a preemption
  decode          decoding alone: its output tokens after the first, each at the cost model's batch-1 step at
                  its mean context
A request that misses both contributes both. The shares are of the summed attributed time, so long requests weigh
more, as they do for users; a miss of TTFT alone never reads as decode time.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

import numpy as np

from servelab.executor.cost_model import CostModel
from servelab.lab.sim.instance import Instance
from servelab.lab.sim.simulate import SimulationResult

TTFT_PARTS = ("queued", "prefill_wait", "prefill")
TPOT_PARTS = ("kv_transfer", "decode_interference", "decode_batch", "decode")
PARTS = TTFT_PARTS + TPOT_PARTS


def prefill_alone_s(cost: CostModel, prompt_len: int) -> float:
    """The prompt's prefill as one step of its own (all its tokens, one row sampled)."""
    pairs = prompt_len * (prompt_len + 1) // 2  # causal: token i scores i + 1 keys
    return cost.step_time(prompt_len, 1, 1, pairs, prompt_len, num_arrivals=1)["total"]


def ttft_parts(times, cost: CostModel, prompt_len: int) -> dict[str, float]:
    prefill_phase = times.first_token - times.first_scheduled
    own = min(prefill_phase, prefill_alone_s(cost, prompt_len))
    return {"queued": times.first_scheduled - times.arrival, "prefill_wait": prefill_phase - own, "prefill": own}


def tpot_parts(times, cost: CostModel, prompt_len: int, num_output: int, transfer: float,
               interference: float) -> dict[str, float]:
    after_first = times.finished - times.first_token
    decode_phase = after_first - transfer
    slowed = min(decode_phase, interference)
    steps = max(0, num_output - 1)
    alone = min(decode_phase - slowed, steps * cost.decode_step_time(1, prompt_len + num_output / 2)) if steps else 0.0
    return {"kv_transfer": transfer, "decode_interference": slowed,
            "decode_batch": decode_phase - slowed - alone, "decode": alone}


def attribute_slo_misses(result: SimulationResult, ttft_ms: float | None, tpot_ms: float | None) -> dict:
    cost = result.deployment.cost_model()
    interference = {i.index: _Interference(i, cost) for i in result.instances if i.role != "prefill"}
    totals = dict.fromkeys(PARTS, 0.0)
    num_ttft = num_tpot = num_missed = 0
    for index, r in enumerate(result.requests):
        t = r.times
        ttft = t.first_token - t.arrival
        n_out = r.num_output_tokens
        tpot = (t.finished - t.first_token) / (n_out - 1) if n_out > 1 else 0.0
        missed_ttft = ttft_ms is not None and ttft * 1000 > ttft_ms
        missed_tpot = tpot_ms is not None and tpot * 1000 > tpot_ms
        if not (missed_ttft or missed_tpot):
            continue
        num_missed += 1
        num_ttft += missed_ttft
        num_tpot += missed_tpot
        parts: dict[str, float] = {}
        if missed_ttft:
            parts.update(ttft_parts(t, cost, r.num_prompt_tokens))
        if missed_tpot:
            transfer = result.request_transfer_s.get(index, 0.0)
            slowed = interference[result.finished_on[index]].between(t.first_token + transfer, t.finished)
            parts.update(tpot_parts(t, cost, r.num_prompt_tokens, n_out, transfer, slowed))
        for k, v in parts.items():
            totals[k] += v
    attributed = sum(totals.values())
    return {
        "ttft_target_ms": ttft_ms, "tpot_target_ms": tpot_ms,
        "num_requests": len(result.requests), "num_missed": num_missed,
        "num_missed_ttft": num_ttft, "num_missed_tpot": num_tpot,
        "share": {k: (v / attributed if attributed > 0 else 0.0) for k, v in totals.items()},
        # per request that missed the part's metric (TTFT parts over TTFT misses, the rest over TPOT misses)
        "mean_ms": {k: (v * 1000 / n if n else 0.0) for k, v in totals.items()
                    for n in [num_ttft if k in TTFT_PARTS else num_tpot]},
    }


class _Interference:
    """One instance's steps that mixed prefill chunks into decode, as cumulative extra seconds over time."""

    def __init__(self, instance: Instance, cost: CostModel) -> None:
        starts, extras = [], []
        log = instance.step_stats
        prefill, decode = log.column("num_prefill_tokens"), log.column("num_decode_requests")
        for index in np.flatnonzero(np.logical_and(prefill, decode)).tolist():
            s = log[index]
            attention = s.breakdown.get("attention", 0.0) * s.num_decode_requests / s.num_scheduled_tokens
            n = s.num_decode_requests
            alone = (cost.weights_time(n, n) + cost.communication_time(n) + cost.overhead_time(n, n) + attention)
            starts.append(s.start)
            extras.append(max(0.0, s.duration - alone))
        self.starts = starts
        self.cumulative = list(accumulate(extras, initial=0.0))

    def between(self, start: float, end: float) -> float:
        """Extra seconds of the mixed steps that started in [start, end)."""
        return self.cumulative[bisect_left(self.starts, end)] - self.cumulative[bisect_left(self.starts, start)]
