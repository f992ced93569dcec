"""The advisor picks the fewest GPUs that meet the targets, and explains each decision."""
import json
import re
from dataclasses import replace
from pathlib import Path

import servelab.lab.web as lab_web
from servelab.lab import api
from servelab.lab.analysis.advisor import advise, shapes
from servelab.lab.analysis.autoscaling import evaluate_autoscaling
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


def _js_clause_patterns() -> list[tuple[re.Pattern, str]]:
    """phrases.js' clause patterns (the page translates each clause of a decision's `why` by them), in Python."""
    source = (Path(lab_web.__file__).parent / "static" / "phrases.js").read_text(encoding="utf-8")
    n, pct = re.search(r'const N = "(.*)";', source).group(1), re.search(r'const PCT = "(.*)";', source).group(1)
    patterns = []
    for literal, key in re.findall(r'\[\s*[`"](.*?)[`"],\s*"(phrase\.scale\.sim_\w+)"\]', source):
        text = literal.replace("${N}", n).replace("${PCT}", pct).replace("\\\\", "\\").replace("(?<", "(?P<")
        patterns.append((re.compile(f"^{text}$"), key))
    return patterns


def test_the_autoscaling_decision_cites_the_simulated_comparison_in_both_languages():
    autoscale = api.AutoscaleRequest(policy="keda", min_replicas=1, max_replicas=4, startup_s=20, cooldown_s=30,
                                     interval_s=10, target_waiting=2)
    # the ramp's peak needs more L4s than its trough and no more than 4 at the shipped calibration (16 sequences
    # a replica). The TPOT target sits well above an L4's 8B decode step (~100 ms at the memory ceiling), so the
    # autoscaler's TPOT ratio does not pin the replica count at whatever it started with.
    request = api.AdviseRequest(api.DeploymentRequest(model="llama-3.1-8b", gpu="l4", max_num_seqs=16),
                                WorkloadConfig(input_len=512, output_len=64, rate_schedule="ramp:0=0.5,150=10,300=0.5"),
                                api.TargetsRequest(ttft_target_ms=2000, tpot_target_ms=200), max_gpus=4,
                                autoscale=autoscale)
    result = api.advise(request)
    rec = result.advice.recommendation
    assert rec is not None
    line = {d["decision"]: d for d in result.advice.decisions}["GPU autoscaling"]
    assert [d["decision"] for d in result.advice.decisions] == DECISIONS
    # the same comparison, simulated on its own
    outcome = evaluate_autoscaling(rec.deployment, generate_workload(request.workload), result.targets,
                                   autoscale.build())
    scaled, fixed = outcome.summaries()
    low, high = outcome.replica_range()
    assert 1 <= low < high <= 4  # the ramp up and down
    saved = 1 - scaled["gpu_hours"] / fixed["gpu_hours"]
    assert line["why"].split("; ")[:4] == [
        f"simulated, the autoscaler kept {low} to {high} replicas serving",
        f"{scaled['gpu_hours']:,.1f} GPU-hours against {fixed['gpu_hours']:,.1f} for a fixed 4 replicas",
        f"it saves {saved:.1%} of the GPU-hours",
        f"{scaled['slo_attainment']:.1%} of requests meet the targets (fixed: {fixed['slo_attainment']:.1%})"]
    assert line["taken"] == (saved > 0 and scaled["slo_attainment"] >= fixed["slo_attainment"] - 0.01)
    # without an autoscaled run the line is the replica-count rule of thumb
    plain = api.advise(replace(request, autoscale=None))
    assert {d["decision"]: d for d in plain.advice.decisions}["GPU autoscaling"]["why"] != line["why"]
    # every clause is one the page translates, with its key in both language files
    patterns = _js_clause_patterns()
    assert len(patterns) == 6
    languages = [json.loads((Path(lab_web.__file__).parent / "static" / "i18n" / f"{lang}.json").read_text("utf-8"))
                 for lang in ("en", "zh")]
    for clause in line["why"].split("; "):
        keys = [key for pattern, key in patterns if pattern.match(clause)]
        assert len(keys) == 1, clause
        assert all(keys[0] in strings for strings in languages)
