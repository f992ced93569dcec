"""The shared workload generator: seeded, vLLM's flag meanings."""
import math

import numpy as np
import pytest

from servelab.workload import WorkloadConfig, generate_workload, sample_arrival_times


def test_same_seed_same_workload_and_lengths_survive_a_rate_change():
    a = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=300, request_rate=4, seed=7))
    assert a == generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=300, request_rate=4, seed=7))
    assert a != generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=300, request_rate=4, seed=8))
    b = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=300, request_rate=9, seed=7))
    assert [(r.prompt_len, r.output_len) for r in a] == [(r.prompt_len, r.output_len) for r in b]


def test_random_range_ratio_is_uniform_around_the_length():
    w = generate_workload(WorkloadConfig(num_prompts=2000, input_len=100, output_len=10, range_ratio=0.5))
    prompts = np.array([r.prompt_len for r in w])
    assert prompts.min() == 50 and prompts.max() == 150 and abs(prompts.mean() - 100) < 3
    fixed = generate_workload(WorkloadConfig(num_prompts=5, input_len=100, output_len=10))
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(100, 10)}


def test_arrivals_rate_inf_and_burstiness():
    assert all(r.arrival_time == 0 for r in generate_workload(WorkloadConfig(num_prompts=10)))
    rng = np.random.default_rng(0)
    poisson = np.diff(sample_arrival_times(20000, 10.0, 1.0, rng))
    bursty = np.diff(sample_arrival_times(20000, 10.0, 0.25, rng))
    assert poisson.mean() == pytest.approx(0.1, rel=0.03) and bursty.mean() == pytest.approx(0.1, rel=0.05)
    # gamma shape k: coefficient of variation 1/sqrt(k)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)


def test_sharegpt_like_shape():
    w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=20000))
    p, o = np.array([r.prompt_len for r in w]), np.array([r.output_len for r in w])
    assert 140 < p.mean() < 180 and 310 < o.mean() < 370
    assert p.min() >= 4 and o.min() >= 4 and p.max() <= 1024 and (p + o).max() <= 2048
    assert np.median(p) < p.mean()  # long right tail
    fixed_out = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=50, output_len=64))
    assert {r.output_len for r in fixed_out} == {64}


@pytest.mark.parametrize("kwargs, message", [
    (dict(range_ratio=1.0), "range_ratio"), (dict(request_rate=0), "request_rate"),
    (dict(num_prompts=0), "num_prompts"), (dict(burstiness=-1), "burstiness"), (dict(dataset="x"), "dataset"),
    (dict(dataset="sharegpt-like", input_len=10), "sharegpt-like"),
])
def test_bad_workloads_say_what_is_wrong(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**kwargs)
    assert math.isinf(WorkloadConfig().request_rate)


def test_prefix_shared_is_vllms_prefix_repetition_shape():
    config = WorkloadConfig(dataset="prefix-shared", num_prompts=400, prefix_len=100, num_prefixes=4, input_len=20,
                            output_len=8, request_rate=3, seed=2)
    w = generate_workload(config)
    assert {(r.prompt_len, r.prefix_len, r.output_len) for r in w} == {(120, 100, 8)}
    assert sorted({r.prefix_group for r in w}) == [0, 1, 2, 3]
    # the same arrivals and (suffix) lengths as random with the same seed
    random = generate_workload(WorkloadConfig(num_prompts=400, input_len=20, output_len=8, request_rate=3, seed=2))
    assert [r.arrival_time for r in w] == [r.arrival_time for r in random]
    assert all(r.prefix_group is None for r in random)
    with pytest.raises(ValueError, match="prefix-shared"):
        WorkloadConfig(prefix_len=10)


def test_eos_cut_keeps_prompts_and_shortens_outputs_to_the_published_mean():
    whole = generate_workload(WorkloadConfig(dataset="sharegpt-llama3", num_prompts=20000))
    cut = generate_workload(WorkloadConfig(dataset="sharegpt-llama3", num_prompts=20000, eos_mean_output=150))
    assert [r.prompt_len for r in cut] == [r.prompt_len for r in whole]
    full, ended = np.array([r.output_len for r in whole]), np.array([r.output_len for r in cut])
    assert (ended <= full).all() and ended.min() >= 1 and (ended < full).any()
    assert ended.mean() == pytest.approx(150, rel=0.03)
    # a constant EOS chance per token cuts long answers more often than short ones
    long, short = full > 600, full < 100
    assert (ended[long] < full[long]).mean() > 3 * (ended[short] < full[short]).mean()


@pytest.mark.parametrize("config", [dict(dataset="sharegpt-like", eos_mean_output=150),
                                    dict(dataset="sharegpt-llama3", eos_mean_output=150, output_len=100),
                                    dict(dataset="sharegpt-llama3", eos_mean_output=0.5)])
def test_eos_mean_output_needs_sharegpt_llama3_lengths(config):
    with pytest.raises(ValueError, match="eos_mean_output"):
        WorkloadConfig(**config)


def test_eos_mean_output_cannot_exceed_the_datasets():
    with pytest.raises(ValueError, match="dataset's"):
        generate_workload(WorkloadConfig(dataset="sharegpt-llama3", num_prompts=10, eos_mean_output=400))
