"""A replica's decode run is cut only where something can reach it (the arrivals its router sends it, a KV
landing, a scrape, a replica joining the router), not at every arrival: every request's timings stay
those of single steps (multi_step=False), on the 30 golden configurations and on autoscaled runs."""
import pytest

from servelab.entrypoints.cli import build_parser
from servelab.lab.analysis.autoscale_policies import AutoscalePolicyConfig, make_autoscaler
from servelab.lab.cli import deployment_request, workload_config
from servelab.lab.sim.load_balancer import LoadBalancer
from servelab.lab.sim.scaling import ScalingConfig
from servelab.lab.sim.simulate import simulate
from servelab.workload import generate_workload

from test_simulate_golden import CONFIGS

# (flags, policy, router): ramps that start and drain replicas under both routers, mixed and disaggregated
_RAMP = ["--model", "llama-3.1-8b", "--gpu", "h100", "--input-len", "300", "--output-len", "60",
         "--rate-schedule", "ramp:0=1,40=40,80=1"]
AUTOSCALED = [
    ([*_RAMP, "--max-num-seqs", "8"], "keda", "round-robin"),
    ([*_RAMP, "--max-num-seqs", "8"], "keda", "least-loaded"),
    ([*_RAMP, "--max-num-seqs", "16"], "dynamo", "round-robin"),
    ([*_RAMP, "--disaggregate", "1:1", "--max-num-seqs", "4"], "keda", "round-robin"),
]


def request_record(result) -> list:
    return [(r.times.arrival, r.times.first_scheduled, r.times.first_token, r.times.finished, list(r.times.token_times),
             r.num_output_tokens, r.num_preemptions, on) for r, on in zip(result.requests, result.finished_on)]


def run_both(flags, autoscaler=None, scaling=None, router=None):
    args = build_parser().parse_args(["lab", "simulate", *flags])
    if router is not None:
        args.router = router
    deployment = deployment_request(args).build()
    workload = generate_workload(workload_config(args))
    return [simulate(deployment, workload, multi_step, autoscaler() if autoscaler else None, scaling)
            for multi_step in (True, False)]


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_request_timings_equal_single_steps_on_the_golden_configurations(index):
    runs, steps = run_both(CONFIGS[index])
    assert request_record(runs) == request_record(steps)
    assert runs.request_transfer_s == steps.request_transfer_s


@pytest.mark.parametrize("flags,policy,router", AUTOSCALED)
def test_autoscaled_request_timings_and_scrapes_equal_single_steps(flags, policy, router):
    config = AutoscalePolicyConfig(policy=policy, interval_s=5, cooldown_s=10, target_waiting=2,
                                   ttft_target_s=0.3, tpot_target_s=0.02)
    runs, steps = run_both(flags, lambda: make_autoscaler(config), ScalingConfig(1, 4, startup_s=5), router)
    assert len({s.num_ready for s in runs.scale_samples}) > 1  # replicas came and went
    assert request_record(runs) == request_record(steps)
    assert runs.scale_samples == steps.scale_samples
    assert [(i.started_at, i.stopped_at) for i in runs.instances] == [(i.started_at, i.stopped_at) for i in steps.instances]
    # the runs spanned arrivals routed elsewhere: far fewer entries than single steps
    assert sum(len(i.step_stats) for i in runs.instances) < sum(len(i.step_stats) for i in steps.instances) / 2


def test_round_robin_turns_are_known_in_advance():
    a, b, c = (type("I", (), {"num_outstanding": 0})() for _ in range(3))
    balancer = LoadBalancer("round-robin", [a, b, c])
    balancer.pick()
    assert [balancer.picks_before(x) for x in (a, b, c)] == [2, 0, 1]
    assert [balancer.pick() for _ in range(3)] == [b, c, a]
    with pytest.raises(ValueError):
        LoadBalancer("least-loaded", [a]).picks_before(a)
