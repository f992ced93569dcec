"""The simulator's compact records (finished requests, step logs, client token times) give the values the
plain representations gave, float for float, so a day of traffic fits in memory without moving a number."""
import itertools
import random
from array import array

import numpy as np
import pytest

from servelab.core.engine_core import StepStats
from servelab.core.decode_runs.run_states import RunStates
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.api_path import ClientTokenTimes, client_timings
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.finished import SimulatedRequest, TimelineTimes
from servelab.lab.sim.simulate import simulate
from servelab.lab.sim.step_log import StepLog
from servelab.metrics.request_stats import PERCENTILES, RequestTiming, compute_metrics
from servelab.workload import WorkloadConfig, generate_workload


def _plain_itl_summary(token_times):
    """request_stats' ITL before the compact path: one flat array, its diff, the gaps across requests dropped."""
    lengths = np.array([len(t) for t in token_times], dtype=np.int64)
    flat = np.fromiter(itertools.chain.from_iterable(token_times), dtype=np.float64, count=int(lengths.sum()))
    gaps = np.diff(flat)
    ends = np.cumsum(lengths)[:-1] - 1
    keep = np.ones(gaps.size, dtype=bool)
    keep[ends[(ends >= 0) & (ends < gaps.size)]] = False
    ms = gaps[keep] * 1000.0
    return {"mean_itl_ms": float(ms.mean()), **{f"{label}_itl_ms": float(np.percentile(ms, q)) for label, q in PERCENTILES}}


def test_itl_summary_is_the_flat_arrays_float_for_float():
    rng = random.Random(7)
    token_times = []
    for _ in range(300):
        t = rng.uniform(0, 5000)
        times = []
        for _ in range(rng.choice([0, 1, 2, rng.randint(3, 400)])):
            t += rng.uniform(1e-3, 0.05)
            times.append(t)
        token_times.append(times)
    timings = [RequestTiming(10, len(t), t[0] - 0.1 if t else 0.0, t[0] if t else 0.0, t[-1] if t else 0.0, t)
               for t in token_times]
    metrics = compute_metrics(timings, 100.0)
    assert {k: v for k, v in metrics.items() if "_itl_" in k} == _plain_itl_summary(token_times)


def test_client_token_times_are_a_shifted_copy():
    engine = array("d", [1000.123456789, 1000.2, 1000.7000001, 1001.25])
    before, after = 0.000600172, 0.000600172 + 0.0003125
    copy = [x + before for x in engine[:-1]] + [engine[-1] + after]
    shifted = ClientTokenTimes(engine, before, after)
    assert len(shifted) == 4 and list(shifted) == copy and shifted == copy
    assert [shifted[i] for i in range(-4, 4)] == copy + copy and shifted[1:3] == copy[1:3]
    assert np.asarray(shifted).tolist() == copy


def test_step_log_gives_back_every_step_stats_it_was_sent():
    sent = [
        StepStats(0.5, 0.01, 300, 290, 10, 12, 3, 0, 0.25, 0, {"weights": 0.004, "attention": 0.003,
                                                               "communication": 0.0, "overhead": 0.003},
                  step_ends=[0.51]),
        StepStats(0.51, 0.2, 400, 0, 10, 9, 0, 0, 0.3, 0, {}, num_steps=40, decode_segments=[(30, 10), (10, 9)],
                  step_ends=[0.51 + 0.005 * k for k in range(1, 41)], run_states=RunStates(9.75, 0.28, 5.5, 10, 0.15, 0.31)),
        StepStats(0.71, 0.02, 1, 0, 1, 1, 0, 1, 1.0, 16, {"other": 0.02}, step_ends=[0.73]),
        StepStats(0.73, 0.0, 0, 0, 0, 0, 0, 0, 0.0, 0, step_ends=[0.73]),
        StepStats(0.74, 0.1, 20, 0, 1, 1, 5, 0, 0.5, 3, {}, num_steps=20, decode_segments=[(20, 1)],
                  step_ends=[0.74 + 0.005 * k for k in range(1, 21)]),
    ] * 100  # more than one packing
    log = StepLog()
    for s in sent:
        log.append(s)
    assert len(log) == len(sent) and list(log) == sent and log[-1] == sent[-1]
    assert [index for index, _ in log.breakdowns_in_order()][:4] == [0, 2, 5, 7]
    assert log.column("num_steps") == [s.num_steps for s in sent] and log.run_indices()[:2] == [1, 4]
    assert list(log.timeline) == [end for s in sent for end in s.step_ends]
    # an entry without run states gives its own state (and its duration as the seconds at its peak)
    assert log.column("mean_running")[:5] == [12, 9.75, 1, 0, 1]
    assert log.column("peak_running")[:5] == [12, 10, 1, 0, 1] and type(log.column("peak_running")[1]) is int
    assert log.column("peak_running_s")[:5] == [0.01, 0.15, 0.02, 0.0, 0.1]
    assert log.column("peak_kv_usage")[:2] == [0.25, 0.31] and log.column("mean_reserved_unused_slots")[:3] == [0, 5.5, 16]
    with pytest.raises(ValueError):
        log.append(StepStats(0.9, 0.1, 8, 0, 8, 8, 0, 0, 0.5, 0, num_steps=2, step_ends=[1.0]))
    with pytest.raises(IndexError):
        log[len(sent)]


def test_a_simulation_keeps_compact_records_that_agree_with_its_step_log():
    d = Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=2, max_num_seqs=16)
    w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=150, request_rate=12))
    result = simulate(d, w)
    assert all(isinstance(r, SimulatedRequest) for r in result.requests)
    assert [r.num_output_tokens for r in result.requests] == [x.output_len for x in w]
    # one token a step on one instance: every request's token times are consecutive step ends of its instance
    ends = {i.index: [e for s in i.step_stats for e in s.step_ends] for i in result.instances}
    for r, instance in zip(result.requests, result.finished_on):
        times = r.times.token_times
        assert isinstance(times, TimelineTimes) and len(times) == r.num_output_tokens
        first = ends[instance].index(times[0])
        assert list(times) == ends[instance][first:first + len(times)] and times[-1] == r.times.finished
    assert sum(len(e) for e in ends.values()) == sum(s.num_steps for i in result.instances for s in i.step_stats)
    timings = client_timings(d, result.requests)
    assert all(isinstance(t.token_times, ClientTokenTimes) for t in timings) == bool(d.efficiency.api_ttft_overhead_s)
    # a KV handoff puts the first token on the prefill instance: the request keeps its own array
    split = simulate(Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=2, num_prefill_instances=1,
                                num_decode_instances=1), w[:20])
    assert all(isinstance(r.times.token_times, array) for r in split.requests if r.num_output_tokens > 1)
