"""The published reference points load, validate, cover what calibration needs, and each one runs in the lab."""
import copy
import math
from dataclasses import replace

import numpy as np
import pytest

from servelab.lab.api import DeploymentRequest, SimulateRequest, simulate
from servelab.lab.catalog import get_model
from servelab.lab.catalog.reference import (
    FIT_SOURCES, REFERENCE_DIR, ReferenceDataError, load_reference_points, parse_point, read_points_file,
    to_simulation)
from servelab.workload import WorkloadConfig, generate_workload

POINTS = load_reference_points()


def _raw_entries() -> list[dict]:
    return [e for source in FIT_SOURCES for e in read_points_file(REFERENCE_DIR / f"{source}.json")]


def test_fitted_sources_have_unique_ids():
    ids = [p.id for p in POINTS]
    assert len(ids) == len(set(ids)) == len(_raw_entries())


def test_coverage():
    assert len(POINTS) >= 30
    assert len({p.gpu for p in POINTS}) >= 3
    params = {p.model: get_model(p.model).num_params for p in POINTS}
    assert any(6e9 < n < 9e9 for n in params.values())  # 7-8B
    assert any(60e9 < n < 80e9 for n in params.values())  # 70B
    tps = {p.tp for p in POINTS}
    assert min(tps) == 1 and max(tps) == 8 and {2, 4} <= tps
    groups = {p.group for p in POINTS}
    assert {"latency-batch<=8", "low-load-ttft", "throughput", "disaggregated"} <= groups
    assert all(p.workload.max_concurrency <= 8 for p in POINTS if p.group == "latency-batch<=8")
    assert {p.load for p in POINTS} == {"low", "high"}
    assert sum(p.disaggregation is not None for p in POINTS) >= 2


def test_values_read_off_figures_carry_a_tolerance():
    figures = [p for p in POINTS if p.metric.read_from == "figure"]
    assert figures and all(0 < p.metric.tolerance < p.metric.value for p in figures)


@pytest.mark.parametrize("mutate, message", [
    (lambda e: e.update(gpu="h300"), "unknown GPU"),
    (lambda e: e.update(model="llama-9-9b"), "unknown model"),
    (lambda e: e["metric"].update(name="goodput"), "unknown metric"),
    (lambda e: e["metric"].update(read_from="figure", tolerance=None), "tolerance"),
    (lambda e: e["workload"]["simulate"].update(dataset="longbench"), "unknown servelab dataset"),
    (lambda e: e.pop("notes"), "missing field"),
    (lambda e: e["source"].pop("where"), "missing field"),
    (lambda e: e.update(disaggregation="1:1", num_gpus=2), "P:D"),
    (lambda e: e.update(disaggregation="1:1"), "num_gpus"),
    (lambda e: e["deployment_flags"].update(quantization="int3"), "unknown quantization"),
    (lambda e: e["deployment_flags"].update(first_token_from_decode=True), "needs a disaggregated point"),
    (lambda e: e["deployment_flags"].update(warp=True), "may set"),
    (lambda e: e["deployment_flags"].update(async_output="yes"), "async_output must be"),
    (lambda e: e["workload"]["simulate"].update(eos_mean_output=0), "eos_mean_output"),
])
def test_validation_rejects_bad_entries(mutate, message):
    entry = copy.deepcopy(_raw_entries()[0])
    parse_point(entry)  # the unmodified entry is valid
    mutate(entry)
    with pytest.raises(ReferenceDataError, match=message):
        parse_point(entry)


def test_num_prompts_caps_but_never_raises_the_source_count():
    batch8 = next(p for p in POINTS if p.group == "latency-batch<=8" and p.workload.num_requests == 8)
    assert to_simulation(batch8, num_prompts=40).workload.num_prompts == 8
    big = next(p for p in POINTS if (p.workload.num_requests or 0) >= 1000)
    assert to_simulation(big, num_prompts=20).workload.num_prompts == 20


def test_disaggregated_points_map_to_prefill_and_decode_instances():
    for p in (p for p in POINTS if p.disaggregation):
        d = DeploymentRequest(**to_simulation(p).deployment.as_kwargs()).build()
        assert (d.num_prefill_instances, d.num_decode_instances) == p.disaggregation
        assert d.num_gpus == p.num_gpus


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.id)
def test_every_point_runs_in_the_lab(point):
    sim = to_simulation(point, num_prompts=24)
    result = simulate(SimulateRequest(deployment=DeploymentRequest(**sim.deployment.as_kwargs()),
                                      workload=sim.workload))
    assert result.evaluation.fits, result.evaluation.reason
    value = result.evaluation.metrics[sim.metric]
    assert math.isfinite(value) and value > 0


def test_sharegpt_llama3_draws_the_measured_dataset():
    w = generate_workload(WorkloadConfig(dataset="sharegpt-llama3", num_prompts=20000))
    prompt, output = np.array([r.prompt_len for r in w]), np.array([r.output_len for r in w])
    # ShareGPT V3 first turns, Llama 3 tokenizer, vLLM's filter (benchmarks/sharegpt_lengths/sharegpt_lengths.txt):
    # means 221.1 / 198.9, output p99 772 (the answers' shelf near 770 tokens)
    assert abs(prompt.mean() / 221.1 - 1) < 0.03 and abs(output.mean() / 198.9 - 1) < 0.03
    assert 740 <= np.percentile(output, 99) <= 800
    assert prompt.max() <= 1024 and (prompt + output).max() <= 2048 and min(prompt.min(), output.min()) >= 4


def test_blog_points_end_their_outputs_at_eos_at_the_published_mean():
    blog = [p for p in POINTS if p.id.startswith("vllm060-blog-") and p.workload.simulate.dataset == "sharegpt-llama3"]
    assert len(blog) == 7 and all(p.workload.simulate.eos_mean_output == 179 for p in blog)
    w = generate_workload(replace(to_simulation(blog[0]).workload, num_prompts=20000))
    assert abs(np.mean([r.output_len for r in w]) / 179 - 1) < 0.03
    others = [p for p in POINTS if p.workload.simulate.eos_mean_output is not None and p not in blog]
    assert not others  # sglang.bench_serving ignores EOS by default; the MI300X post does not say


def test_sharegpt_llama3_takes_no_fixed_input_len():
    with pytest.raises(ValueError, match="sharegpt-llama3"):
        WorkloadConfig(dataset="sharegpt-llama3", input_len=100)
