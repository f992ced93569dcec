"""The advisor picks the fewest GPUs that meet the targets, and explains each decision."""
from servelab.lab.analysis.advisor import advise, shapes
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.analysis.evaluate import Targets, evaluate
from servelab.workload import WorkloadConfig, generate_workload

DECISIONS = ["KV-cache management", "Continuous batching", "Tensor-parallel sharding", "Prefill/decode split",
             "GPU autoscaling", "Token streaming"]


def test_fewest_gpus_meeting_ttft_and_tpot_on_a_small_case():
    model, device = get_model("llama-3.1-8b"), get_device("l4")
    w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=150, request_rate=2))
    targets = Targets(ttft_ms=1000, tpot_ms=60)
    advice = advise(model, device, w, targets, max_gpus=8)
    rec = advice.recommendation
    assert rec is not None and rec.meets_targets
    assert rec.deployment.num_gpus == 2 and rec.deployment.tensor_parallel_size == 2
    # nothing with one GPU meets them: an L4 streams the 16 GB of weights in more than 60 ms per step
    one_gpu = [evaluate(d, w, targets) for d in shapes(Deployment(model, device, num_gpus=1), 1)]
    assert one_gpu and not any(e.meets_targets for e in one_gpu)
    assert [d["decision"] for d in advice.decisions] == DECISIONS
    taken = {d["decision"]: d["taken"] for d in advice.decisions}
    assert taken["Tensor-parallel sharding"] and taken["Continuous batching"] and not taken["Prefill/decode split"]
    assert advice.to_json()["recommendation"]["deployment"]["tp"] == 2


def test_no_recommendation_when_nothing_fits():
    advice = advise(get_model("llama-3.1-405b"), get_device("l4"),
                    generate_workload(WorkloadConfig(num_prompts=5, input_len=64, output_len=8)), Targets(ttft_ms=100),
                    max_gpus=4)
    assert advice.recommendation is None and advice.decisions == []
