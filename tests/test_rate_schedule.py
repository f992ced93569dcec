"""--rate-schedule: the arrivals follow the curve (counts per segment), a trace replays exactly, bad specs name
the field, and a workload without a schedule is what it was."""
import numpy as np
import pytest

from servelab.errors import FieldError
from servelab.lab import api
from servelab.lab.cli import build_lab_parser, workload_config
from servelab.rate_schedule import parse_rate_schedule
from servelab.workload import WorkloadConfig, describe, generate_workload


def arrivals(schedule, seed=0, **kw):
    w = generate_workload(WorkloadConfig(rate_schedule=schedule, seed=seed, **kw))
    return np.array([r.arrival_time for r in w])


def test_steps_put_the_expected_number_in_each_step():
    t = arrivals("steps:0=2,600=8,1200=2,1800=2")
    counts = np.histogram(t, bins=[0, 600, 1200, 1800])[0]
    # Poisson counts: mean 1200 / 4800 / 1200, standard deviation under 70
    assert abs(counts[0] - 1200) < 200 and abs(counts[1] - 4800) < 350 and abs(counts[2] - 1200) < 200
    assert np.all(np.diff(t) >= 0) and t[-1] < 1800


def test_ramp_and_diurnal_follow_their_curve():
    t = arrivals("ramp:0=1,900=20,1800=1")
    assert abs(len(t) - 18900) < 600  # the integral: 10.5 req/s mean over 1800 s
    first, middle = np.histogram(t, bins=[0, 300, 750, 1050])[0][[0, 2]]
    assert middle > 3 * first
    s = parse_rate_schedule("diurnal:mean=10,peak=18,hours=1")
    assert s.rate_at(np.array([0.0]))[0] == pytest.approx(2.0) and s.duration == 3600
    assert s.rate_at(np.array([43200.0]))[0] == pytest.approx(18.0)


def test_a_trace_replays_its_arrival_times(tmp_path):
    path = tmp_path / "arrivals.txt"
    path.write_text("5.0\n5.5\n7.25\n12\n")
    w = generate_workload(WorkloadConfig(rate_schedule=f"trace:{path}", input_len=64, output_len=8))
    assert [r.arrival_time for r in w] == [0.0, 0.5, 2.25, 7.0]
    assert [r.prompt_len for r in w] == [64] * 4


def test_same_seed_same_arrivals_and_lengths_stay_independent_of_the_schedule():
    a, b = arrivals("ramp:0=1,60=5,120=1", seed=3), arrivals("ramp:0=1,60=5,120=1", seed=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrivals("ramp:0=1,60=5,120=1", seed=4))


@pytest.mark.parametrize("spec", ["ramp", "ramp:", "wave:0=1,10=2", "steps:0=1", "ramp:5=1,10=2",
                                  "ramp:0=1,10=-2", "diurnal:mean=10,peak=30", "diurnal:avg=3",
                                  "trace:/nonexistent/arrivals.txt", "steps:0=0,10=0"])
def test_bad_schedules_name_the_field(spec):
    with pytest.raises(FieldError) as err:
        generate_workload(WorkloadConfig(rate_schedule=spec))
    assert err.value.field == "rate_schedule"


def test_cli_flag_reaches_the_workload_and_json_keeps_old_keys_without_it():
    args = build_lab_parser().parse_args(["simulate", "--rate-schedule", "steps:0=1,10=1"])
    assert workload_config(args).rate_schedule == "steps:0=1,10=1"
    assert "rate_schedule" not in api.workload_json(WorkloadConfig())
    assert describe(workload_config(args)).startswith("requests arriving on a steps schedule")
