"""Per-request SLO-miss attribution, against the metric each request missed: a TTFT miss splits its time to the
first token (queued, waiting behind others' prefills, its own prefill), a TPOT miss its time after the first token
(KV transfer, prefill interference, sharing steps with other decodes, decoding alone); the parts add up exactly, a
lone request's own prefill and KV transfer are the simulator's, and a TTFT-only workload shows no decode time."""
import pytest

from servelab.lab import api
from servelab.lab.analysis.slo_attribution import PARTS, TPOT_PARTS, TTFT_PARTS, attribute_slo_misses
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
    r = result.requests[0]
    ttft = attribute_slo_misses(result, ttft_ms=0.001, tpot_ms=None)
    assert ttft["num_missed"] == ttft["num_missed_ttft"] == 1
    assert ttft["mean_ms"]["queued"] == 0
    # alone, its prefill is one step of its own prompt: nothing to wait behind
    assert ttft["mean_ms"]["prefill_wait"] == pytest.approx(0, abs=1e-6)
    assert sum(ttft["mean_ms"].values()) == pytest.approx((r.times.first_token - r.arrival_time) * 1000)
    assert all(ttft["share"][k] == 0 for k in TPOT_PARTS)
    tpot = attribute_slo_misses(result, ttft_ms=None, tpot_ms=0.001)
    assert tpot["mean_ms"]["kv_transfer"] == pytest.approx(result.request_transfer_s[0] * 1000)
    assert tpot["mean_ms"]["decode_interference"] == 0
    assert tpot["mean_ms"]["decode_batch"] == pytest.approx(0, abs=1e-6)  # no other decode shared its steps
    assert sum(tpot["mean_ms"].values()) == pytest.approx((r.times.finished - r.times.first_token) * 1000)
    assert all(tpot["share"][k] == 0 for k in TTFT_PARTS)


def test_a_ttft_miss_reads_as_waiting_not_decode():
    """A burst of long prompts with a first-token target only: every missed request waited for the first
    token, and nothing of its decode is counted against it."""
    w = generate_workload(WorkloadConfig(input_len=4096, output_len=256, num_prompts=64, request_rate=float("inf"),
                                         seed=3))
    out = attribute_slo_misses(simulate(deployment(), w), ttft_ms=200, tpot_ms=None)
    assert out["num_missed"] == out["num_missed_ttft"] > 32 and out["num_missed_tpot"] == 0
    assert sum(out["share"][k] for k in TPOT_PARTS) == 0
    assert out["share"]["queued"] + out["share"]["prefill_wait"] > out["share"]["prefill"]  # the queue, not itself
    assert sum(out["share"].values()) == pytest.approx(1.0)


def test_prefill_interference_shows_when_colocated_and_not_on_a_decode_pool():
    w = busy_workload()
    colocated = attribute_slo_misses(simulate(deployment(num_gpus=2), w), ttft_ms=100, tpot_ms=15)
    split = attribute_slo_misses(simulate(deployment(num_gpus=2, num_prefill_instances=1, num_decode_instances=1),
                                          w), ttft_ms=100, tpot_ms=15)
    for out in (colocated, split):
        assert out["num_missed"] > 0
        assert sum(out["share"].values()) == pytest.approx(1.0)
        assert set(out["share"]) == set(PARTS)
        assert all(v >= 0 for v in out["share"].values())
    assert colocated["share"]["decode_interference"] > 0.05 and colocated["share"]["kv_transfer"] == 0
    assert split["share"]["decode_interference"] == 0 and split["share"]["kv_transfer"] > 0


def test_json_has_it_only_when_asked_and_it_needs_a_target():
    base = dict(workload=WorkloadConfig(num_prompts=50, request_rate=20),
                targets=api.TargetsRequest(ttft_target_ms=50))
    assert "slo_misses" not in api.simulate(api.SimulateRequest(**base)).to_json()
    assert "slo_misses" in api.simulate(api.SimulateRequest(**base, slo_attribution=True)).to_json()
    with pytest.raises(ValueError, match="slo_attribution"):
        api.simulate(api.SimulateRequest(workload=base["workload"], slo_attribution=True))
