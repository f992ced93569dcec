"""Per-request SLO-miss attribution: the parts add up to the missed requests' latency, a lone request's KV
transfer is the simulator's own, a P/D decode pool sees no prefill interference and a colocated one does."""
import pytest

from servelab.lab import api
from servelab.lab.analysis.slo_attribution import PARTS, attribute_slo_misses
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.simulate import simulate
from servelab.workload import WorkloadConfig, generate_workload


def deployment(**kw):
    return Deployment(get_model("llama-3.1-8b"), get_device("h100"), **{"num_gpus": 1, **kw})


def busy_workload():
    return generate_workload(WorkloadConfig(input_len=4096, output_len=256, range_ratio=0.5, num_prompts=300,
                                            request_rate=12, seed=2))


def test_a_lone_request_splits_exactly():
    w = generate_workload(WorkloadConfig(input_len=2000, output_len=50, num_prompts=1))
    result = simulate(deployment(num_gpus=2, num_prefill_instances=1, num_decode_instances=1), w)
    out = attribute_slo_misses(result, ttft_ms=0.001, tpot_ms=None)
    r = result.requests[0]
    assert out["num_missed"] == out["num_missed_ttft"] == 1
    assert out["mean_ms"]["queued"] == 0
    assert out["mean_ms"]["kv_transfer"] == pytest.approx(result.request_transfer_s[0] * 1000)
    assert out["mean_ms"]["decode_interference"] == 0
    assert sum(out["mean_ms"].values()) == pytest.approx((r.times.finished - r.arrival_time) * 1000)


def test_prefill_interference_shows_when_colocated_and_not_on_a_decode_pool():
    w = busy_workload()
    colocated = attribute_slo_misses(simulate(deployment(num_gpus=2), w), ttft_ms=100, tpot_ms=15)
    split = attribute_slo_misses(simulate(deployment(num_gpus=2, num_prefill_instances=1, num_decode_instances=1),
                                          w), ttft_ms=100, tpot_ms=15)
    for out in (colocated, split):
        assert out["num_missed"] > 0
        assert sum(out["share"].values()) == pytest.approx(1.0)
        assert set(out["share"]) == set(PARTS)
    assert colocated["share"]["decode_interference"] > 0.05 and colocated["share"]["kv_transfer"] == 0
    assert split["share"]["decode_interference"] == 0 and split["share"]["kv_transfer"] > 0


def test_json_has_it_only_when_asked_and_it_needs_a_target():
    base = dict(workload=WorkloadConfig(num_prompts=50, request_rate=20),
                targets=api.TargetsRequest(ttft_target_ms=50))
    assert "slo_misses" not in api.simulate(api.SimulateRequest(**base)).to_json()
    assert "slo_misses" in api.simulate(api.SimulateRequest(**base, slo_attribution=True)).to_json()
    with pytest.raises(ValueError, match="slo_attribution"):
        api.simulate(api.SimulateRequest(workload=base["workload"], slo_attribution=True))
