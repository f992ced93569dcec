"""A decode run's StepStats says what its single steps' StepStats would have said about the scheduler's state:
the state after its last step, and in run_states the means (weighted by step durations) and peaks of the
states after each step; the lab's meters read from runs equal those read from single steps."""
import contextlib
import io
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from servelab.core.decode_runs.run_states import run_states
from servelab.entrypoints.cli import main

from test_multi_step import CASES, drive, make

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab" / "sim"))
from test_simulate_golden import CONFIGS  # noqa: E402  (the simulator's golden deployments)


def _states_after_steps(stats):
    """{start of a single step: its StepStats}"""
    return {s.start: s for s in stats}


@pytest.mark.parametrize("shared_prefixes", [False, True], ids=["", "prefix-caching"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_run_states_sum_up_the_single_steps(case, seed, shared_prefixes):
    if shared_prefixes and case[0] != "continuous":
        pytest.skip("prefix caching is for paged allocation")
    (single, single_stats), arrivals = make(*case, seed, decode_runs=False, shared_prefixes=shared_prefixes)
    drive((single, single_stats), arrivals, rng=random.Random(seed))
    (engine, stats), arrivals = make(*case, seed, decode_runs=True, shared_prefixes=shared_prefixes)
    drive((engine, stats), arrivals, rng=random.Random(seed))
    by_start = _states_after_steps(single_stats)
    num_with_departures = 0
    for s in stats:
        steps = [by_start[t] for t in [s.start, *s.step_ends[:-1]]]
        last = steps[-1]
        assert (s.num_running, s.num_waiting, s.kv_usage, s.num_reserved_unused_slots) == (
            last.num_running, last.num_waiting, last.kv_usage, last.num_reserved_unused_slots)
        assert all(step.num_waiting == s.num_waiting for step in steps)  # nobody joins the queue during a run
        if s.num_steps == 1:
            assert s.run_states is None
            continue
        durations = [step.duration for step in steps]
        total = sum(durations)

        def mean(name):
            return sum(getattr(step, name) * d for step, d in zip(steps, durations)) / total

        peak_running = max(step.num_running for step in steps)
        expected = (mean("num_running"), mean("kv_usage"), mean("num_reserved_unused_slots"), peak_running,
                    sum(d for step, d in zip(steps, durations) if step.num_running == peak_running),
                    max(step.kv_usage for step in steps))
        r = s.run_states
        got = (r.mean_running, r.mean_kv_usage, r.mean_reserved_unused_slots, r.peak_running, r.peak_running_s,
               r.peak_kv_usage)
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)
        num_with_departures += s.num_running < steps[0].num_running
    assert any(s.run_states is not None for s in stats)
    if case[0] == "continuous" and not shared_prefixes and seed == 0:
        assert num_with_departures  # runs that members left during


def test_run_states_from_events():
    # 4 steps of 1 s from t=10; 3 members, 5 of 10 blocks used and 6 slots unfilled before; a block taken in
    # steps 2 and 3; one member leaves after step 2 freeing 2 blocks and 1 unfilled slot.
    s = run_states(10.0, [11.0, 12.0, 13.0, 14.0], 3, 5, 6, 10, 4, [2, 3], [(2, 2, 1)])
    # after each step: every member fills a slot a step, a block brings 4 slots
    running = [3, 2, 2, 2]
    used = [5, 5 + 1 - 2, 4 + 1, 5]
    unused = [6 - 3, 3 + 4 - 3 - 1, 3 + 4 - 2, 5 - 2]
    assert s.mean_running == pytest.approx(sum(running) / 4)
    assert s.mean_kv_usage == pytest.approx(sum(used) / 40)
    assert s.mean_reserved_unused_slots == pytest.approx(sum(unused) / 4)
    assert (s.peak_running, s.peak_running_s, s.peak_kv_usage) == (3, 1.0, 0.5)


# stages 1-3, replicas, tensor parallel, P/D, KV pressure and small blocks: with runs, and with --single-step
_METER_CONFIGS = [CONFIGS[i] for i in (0, 1, 2, 4, 13, 18, 22, 23, 25)]


def _meters(flags):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["lab", "simulate", *flags, "--json"]) == 0
    return json.loads(out.getvalue())["meters"]


@pytest.mark.parametrize("flags", _METER_CONFIGS, ids=range(len(_METER_CONFIGS)))
def test_meters_from_runs_equal_single_steps(flags):
    runs, steps = _meters(flags), _meters([*flags, "--single-step"])
    for meter, keys in (("kv_cache", ("peak_usage", "mean_usage", "reserved_unused_share")),
                        ("batch_slots", ("mean_running", "peak_running", "mean_saturation", "full_with_waiting_share")),
                        ("queue", ("mean_waiting", "peak_waiting", "series"))):
        for key in keys:
            if key in steps[meter]:
                got, expected = np.ravel(runs[meter][key]), np.ravel(steps[meter][key])
                assert got == pytest.approx(expected, rel=1e-9, abs=1e-12), (meter, key)
