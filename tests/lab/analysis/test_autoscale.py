"""Autoscaling over time: replicas follow a ramp up and down, a removed replica drains (no request lost, none
routed to it after it left), the same seed gives the same bytes, and the policies follow their formulas."""
import json

import pytest

from servelab.lab import api
from servelab.lab.analysis.autoscale_policies import AutoscalePolicyConfig, DynamoPlanner, KedaHpa, make_autoscaler
from servelab.lab.analysis.autoscaling import evaluate_autoscaling
from servelab.lab.analysis.evaluate import Targets
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.scaling import PoolMetrics, ScalingConfig
from servelab.lab.sim.simulate import simulate
from servelab.workload import WorkloadConfig, generate_workload

RAMP = "ramp:0=0.5,200=8,400=0.5"
SCALING = ScalingConfig(min_replicas=1, max_replicas=4, startup_s=20)


def l4_deployment(**kw):
    return Deployment(get_model("llama-3.1-8b"), get_device("l4"), **{"num_gpus": 1, "max_num_seqs": 32, **kw})


def ramp_workload(schedule=RAMP, seed=0, input_len=512):
    return generate_workload(WorkloadConfig(input_len=input_len, output_len=64, rate_schedule=schedule, seed=seed))


def policy(name="keda", **kw):
    return make_autoscaler(AutoscalePolicyConfig(**{"policy": name, "interval_s": 10, "cooldown_s": 30,
                                                    "target_waiting": 2, **kw}))


def check_no_request_lost(result, workload):
    assert len(result.requests) == len(workload)
    for index, (r, w) in enumerate(zip(result.requests, workload)):
        assert r.request_id == str(index)
        assert r.num_output_tokens == w.output_len
        assert r.times.arrival <= r.times.first_token <= r.times.finished
    for inst in result.instances:
        inst.core.scheduler.block_manager.check_invariants()
        assert inst.core.scheduler.block_manager.num_free_blocks == inst.core.scheduler.block_manager.num_blocks
        assert inst.num_outstanding == 0


@pytest.mark.parametrize("name", ["keda", "dynamo"])
def test_replicas_rise_and_fall_with_a_ramp_and_no_request_is_lost(name):
    workload = ramp_workload()
    result = simulate(l4_deployment(), workload, autoscaler=policy(name), scaling=SCALING)
    check_no_request_lost(result, workload)
    ready = [s.num_ready for s in result.scale_samples]
    peak = ready.index(max(ready))
    assert ready[0] == 1 and max(ready) >= 3
    assert ready[-1] < max(ready)  # back down after the ramp
    assert len(result.instances) > 1
    # a replica serves only once booted: startup_s after it was started
    for inst in result.instances[1:]:
        first = min((r.times.first_scheduled for i, r in enumerate(result.requests)
                     if result.finished_on[i] == inst.index), default=None)
        if first is not None:
            assert first >= inst.started_at + SCALING.startup_s
    assert peak > 0


def test_a_removed_replica_drains_takes_nothing_new_and_gives_its_gpu_back_after_its_last_request():
    workload = ramp_workload()
    result = simulate(l4_deployment(), workload, autoscaler=policy("keda"), scaling=SCALING)
    drained = [inst for inst in result.instances if inst.draining_since is not None and inst.stopped_at is not None
               and inst.started_at + SCALING.startup_s <= inst.draining_since]
    assert drained, "the ramp's way down removes replicas"
    for inst in drained:
        mine = [r for i, r in enumerate(result.requests) if result.finished_on[i] == inst.index]
        assert all(r.arrival_time <= inst.draining_since for r in mine)  # the router stopped at the drain
        last = max((r.times.finished for r in mine), default=inst.draining_since)
        assert inst.stopped_at == pytest.approx(max(last, inst.draining_since))
    assert result.gpu_seconds() < len(result.instances) * result.duration


def test_disaggregated_pools_scale_separately_and_lose_nothing():
    workload = ramp_workload(input_len=2048)  # long prompts load the prefill pool too
    d = l4_deployment(num_gpus=2, num_prefill_instances=1, num_decode_instances=1)
    result = simulate(d, workload, autoscaler=policy("dynamo"), scaling=SCALING)
    check_no_request_lost(result, workload)
    roles = {s.role for s in result.scale_samples}
    assert roles == {"prefill", "decode"}
    for role in roles:
        ready = [s.num_ready for s in result.scale_samples if s.role == role]
        assert ready[0] == 1 and max(ready) > 1 and ready[-1] == 1
        assert any(s.num_starting for s in result.scale_samples if s.role == role)


def test_same_seed_same_bytes_and_another_seed_differs():
    def run(seed):
        request = api.SimulateRequest(
            api.DeploymentRequest(gpu="l4", max_num_seqs=32),
            WorkloadConfig(input_len=512, output_len=64, rate_schedule="ramp:0=0.5,100=8,200=0.5", seed=seed),
            api.TargetsRequest(ttft_target_ms=500, tpot_target_ms=150),
            autoscale=api.AutoscaleRequest(max_replicas=4, startup_s=20, cooldown_s=30, interval_s=10,
                                           target_waiting=2),
            slo_attribution=True)
        return api.format_json(api.simulate(request).to_json())
    first = run(0)
    assert first == run(0)
    assert first != run(1)
    payload = json.loads(first)
    assert {"autoscaling", "slo_misses"} <= payload.keys()
    assert payload["workload"]["rate_schedule"] == "ramp:0=0.5,100=8,200=0.5"


def test_autoscaled_vs_fixed_peak_deployment():
    workload = ramp_workload()
    from servelab.lab.analysis.autoscaling import AutoscaleSettings
    settings = AutoscaleSettings(AutoscalePolicyConfig(interval_s=10, cooldown_s=30, target_waiting=2), SCALING)
    outcome = evaluate_autoscaling(l4_deployment(), workload, Targets(ttft_ms=500, tpot_ms=150), settings)
    out = outcome.to_json()
    assert out["fixed"]["num_replicas_peak"] == 4
    assert out["fixed"]["gpu_hours"] == pytest.approx(4 * out["fixed"]["duration_s"] / 3600)
    assert 0 < out["autoscaled"]["gpu_hours"] < out["fixed"]["gpu_hours"]
    assert out["gpu_hours_saved_share"] > 0
    timeline = out["timeline"]["mixed"]
    assert len(timeline["time_s"]) == len(timeline["num_ready"]) == len(timeline["kv_usage"])
    assert sum(timeline["arrival_rate"]) * 10 == pytest.approx(len(workload) - sum(
        1 for w in workload if w.arrival_time >= timeline["time_s"][-1]))
    assert "GPU-hours" in out["decision"] and "fixed 4 replicas" in out["decision"]


def metrics(role="mixed", ready=2, starting=0, waiting=0.0, kv=0.0, ttft=None, tpot=None):
    return PoolMetrics(role, ready, starting, waiting, kv, ttft, tpot)


def test_keda_hpa_formula_tolerance_and_scale_down_stabilization():
    hpa = KedaHpa(AutoscalePolicyConfig(target_waiting=5, target_kv_usage=0.8, cooldown_s=300))
    assert hpa.desired_replicas(metrics(waiting=12), 0) == 5  # ceil(2 * 12 / 5)
    assert hpa.desired_replicas(metrics(waiting=5.4), 30) == 2  # within 10% of the target: no change
    assert hpa.desired_replicas(metrics(kv=0.96, waiting=1), 60) == 3  # the largest metric wins: ceil(2 * 1.2)
    # down to 1 only once the higher recommendations left the 300 s window
    assert hpa.desired_replicas(metrics(ready=3), 90) == 3
    assert hpa.desired_replicas(metrics(ready=3), 301) == 3  # 3 (t=60) is still in the window
    assert hpa.desired_replicas(metrics(ready=3), 361) == 0  # the simulator clamps it to min_replicas


def test_dynamo_planner_one_step_at_a_time_and_waits_for_a_change_to_land():
    planner = DynamoPlanner(AutoscalePolicyConfig(policy="dynamo", target_waiting=5, target_kv_usage=0.9,
                                                  cooldown_s=60, tpot_target_s=0.05))
    assert planner.desired_replicas(metrics(waiting=50), 0) == 3  # +1, however long the queue
    assert planner.desired_replicas(metrics(ready=2, starting=1, waiting=50), 10) == 3  # blocked while adding
    assert planner.desired_replicas(metrics(ready=3, tpot=0.08), 20) == 4  # a missed TPOT target scales up
    assert planner.desired_replicas(metrics(ready=4), 30) == 4  # idle, but within the cool-down
    assert planner.desired_replicas(metrics(ready=4), 80) == 3


def test_scaling_limits_are_checked():
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="autoscale"):
        AutoscalePolicyConfig(policy="hpa")
