"""Where the latency of the requests that miss a target went: queued, in prefill, in KV transfer, in decode
slowed by other requests' prefills, and the rest of decode.

Each missed request's end-to-end latency (arrival to last token) splits exactly into
  queued        arrival -> first scheduled
  prefill       first scheduled -> first token (chunked prefill's steps included)
  kv_transfer   the prompt's KV crossing from a prefill to a decode instance (P/D only)
  decode_interference  within the decode phase, the extra time of the steps that also ran others' prefill
                chunks: each such step's duration less what the cost model gives for its decode tokens alone
  decode        the rest
The shares are of the summed latency of the missed requests, so long requests weigh more, as they do for users.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

import numpy as np

from servelab.executor.cost_model import CostModel
from servelab.lab.sim.instance import Instance
from servelab.lab.sim.simulate import SimulationResult

PARTS = ("queued", "prefill", "kv_transfer", "decode_interference", "decode")


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
        transfer = result.request_transfer_s.get(index, 0.0)
        decode_phase = t.finished - t.first_token - transfer
        slowed = min(decode_phase, interference[result.finished_on[index]].between(t.first_token + transfer,
                                                                                   t.finished))
        totals["queued"] += t.first_scheduled - t.arrival
        totals["prefill"] += t.first_token - t.first_scheduled
        totals["kv_transfer"] += transfer
        totals["decode_interference"] += slowed
        totals["decode"] += decode_phase - slowed
    latency = sum(totals.values())
    return {
        "ttft_target_ms": ttft_ms, "tpot_target_ms": tpot_ms,
        "num_requests": len(result.requests), "num_missed": num_missed,
        "num_missed_ttft": num_ttft, "num_missed_tpot": num_tpot,
        "share": {k: (v / latency if latency > 0 else 0.0) for k, v in totals.items()},
        "mean_ms": {k: (v * 1000 / num_missed if num_missed else 0.0) for k, v in totals.items()},
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

