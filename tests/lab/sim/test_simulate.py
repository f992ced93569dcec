"""The simulator: steps through the engine's own EngineCore, determinism, monotone answers, non-fitting shapes."""
import math
import subprocess
import sys

import pytest

from servelab.errors import FieldError

from servelab.core.block_manager import BlockManager
from servelab.core.engine_core import EngineCore
from servelab.core.scheduler import Scheduler
from servelab.lab.sim import instance as lab_instance
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment
from servelab.lab.analysis.evaluate import Targets, evaluate
from servelab.lab.sim.simulate import DoesNotFit, simulate
from servelab.workload import WorkloadConfig, generate_workload


def deployment(model="llama-3.1-8b", gpu="h100", **kw):
    return Deployment(get_model(model), get_device(gpu), **{"num_gpus": 1, **kw})


def workload(**kw):
    return generate_workload(WorkloadConfig(**{"dataset": "sharegpt-like", "num_prompts": 200, "request_rate": 8,
                                               **kw}))


class SpyEngineCore(EngineCore):
    """Counts the calls of the step function the core chose, and the steps they reported."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_calls = self.num_steps = 0

    def step_fn(self, horizon=math.inf):
        out = super().step_fn(horizon)
        self.num_calls += 1
        self.num_steps += out.stats.num_steps if out.stats is not None else 0
        return out


@pytest.mark.parametrize("shape", [dict(), dict(schedule="static"),
                                   dict(num_gpus=3, num_prefill_instances=1, num_decode_instances=2)])
def test_simulator_steps_through_engine_core(monkeypatch, shape):
    """Every step the simulator takes is an EngineCore step function call, and each call's StepStats
    reached the instance's sink: the steps they count are the single-step simulation's, one by one."""
    monkeypatch.setattr(lab_instance, "EngineCore", SpyEngineCore)
    d, w = deployment(**shape), workload(num_prompts=60, request_rate=20)
    fast, slow = simulate(d, w), simulate(d, w, multi_step=False)
    for result in (fast, slow):
        for inst in result.instances:
            engine = inst.core
            assert type(engine) is SpyEngineCore and engine.num_calls > 0
            assert type(engine.scheduler) is Scheduler and type(engine.scheduler.block_manager) is BlockManager
            assert engine.num_calls == len(inst.step_stats)
            assert engine.num_steps == sum(s.num_steps for s in inst.step_stats)
            bm = engine.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_blocks
            bm.check_invariants()
    assert [i.core.num_steps for i in fast.instances] == [i.core.num_steps for i in slow.instances]
    assert any(s.num_steps > 1 for i in fast.instances for s in i.step_stats)
    # single steps: every token of every request is stamped with the end of a step the sink saw
    ends = {s.start + s.duration for i in slow.instances for s in i.step_stats}
    assert all(t in ends for r in slow.requests for t in r.times.token_times)


def test_lab_never_imports_torch():
    code = ("import sys; from servelab.lab.cli import main; "
            "main(['simulate', '--num-prompts', '20', '--json']); assert 'torch' not in sys.modules, 'torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("shape", [
    dict(), dict(schedule="static"), dict(schedule="serial"),
    dict(num_gpus=4, tensor_parallel_size=2, router="least-loaded"),
    dict(num_gpus=3, num_prefill_instances=1, num_decode_instances=2, router="least-loaded"),
])
def test_multi_step_runs_change_nothing(shape):
    w = workload(num_prompts=120, request_rate=30)
    d = deployment(max_num_seqs=32, **shape)
    fast, slow = simulate(d, w), simulate(d, w, multi_step=False)
    key = [(r.num_output_tokens, r.times.token_times, r.times.first_scheduled, r.num_preemptions)
           for r in fast.requests]
    assert key == [(r.num_output_tokens, r.times.token_times, r.times.first_scheduled, r.num_preemptions)
                   for r in slow.requests]
    assert (sum(s.num_steps for i in fast.instances for s in i.step_stats)
            == sum(s.num_steps for i in slow.instances for s in i.step_stats))


def test_preemption_under_kv_pressure_and_every_request_completes():
    # Llama-3.1-8B on a 24 GB L4 leaves ~3.6 GiB of KV: 300 long requests at once cannot all fit.
    w = generate_workload(WorkloadConfig(num_prompts=300, input_len=512, output_len=512))
    result = simulate(deployment(gpu="l4"), w)
    assert sum(r.num_preemptions for r in result.requests) > 0
    assert all(r.num_output_tokens == 512 for r in result.requests)


def test_more_gpus_never_slower_at_equal_load():
    w = workload(request_rate=40)
    e2e, ttft = [], []
    for n in (1, 2, 4):
        m = evaluate(deployment(gpu="l4", num_gpus=n), w).metrics
        e2e.append(m["mean_e2el_ms"])
        ttft.append(m["p99_ttft_ms"])
    assert e2e == sorted(e2e, reverse=True) and ttft == sorted(ttft, reverse=True)


def test_longer_prompts_never_lower_ttft():
    medians, p99s = [], []
    for input_len in (128, 512, 2048):
        w = generate_workload(WorkloadConfig(num_prompts=100, input_len=input_len, output_len=32, request_rate=10))
        m = evaluate(deployment(), w).metrics
        medians.append(m["median_ttft_ms"])
        p99s.append(m["p99_ttft_ms"])
    assert medians == sorted(medians) and p99s == sorted(p99s)


def test_higher_rate_never_lower_queueing():
    waits = []
    for rate in (2, 8, 32, float("inf")):
        e = evaluate(deployment(gpu="a10g"), workload(request_rate=rate))
        waits.append(e.meters["queue"]["mean_queue_ms"])
    assert waits == sorted(waits)


def test_deployment_that_does_not_fit_is_reported_with_numbers():
    d = deployment(model="llama-3.1-405b")
    with pytest.raises(DoesNotFit) as err:
        simulate(d, workload(num_prompts=5))
    assert err.value.memory.weight_bytes == get_model("llama-3.1-405b").num_params * 2
    assert "756.0 GiB per GPU" in str(err.value)
    e = evaluate(d, workload(num_prompts=5), Targets(ttft_ms=500))
    assert not e.fits and not e.meets_targets and e.meters["weights"]["share_of_memory"] > 9


def test_bad_shapes_are_field_errors():
    with pytest.raises(FieldError, match="num_gpus 3 is not a multiple of tp 2") as err:
        deployment(num_gpus=3, tensor_parallel_size=2)
    assert err.value.fields == ("num_gpus", "tp")
    assert err.value.render(lambda f: "--" + f.replace("_", "-")) == "--num-gpus 3 is not a multiple of --tp 2"
    with pytest.raises(ValueError, match="needs 4 GPUs"):
        deployment(num_gpus=3, num_prefill_instances=1, num_decode_instances=3)
    with pytest.raises(ValueError, match="does not divide"):
        deployment(model="qwen2.5-7b", num_gpus=8, tensor_parallel_size=8)


def test_prefix_caching_skips_the_shared_prefix_prefill():
    w = generate_workload(WorkloadConfig(dataset="prefix-shared", num_prompts=100, prefix_len=512, num_prefixes=2,
                                         input_len=32, output_len=16, request_rate=4))
    on, off = simulate(deployment(), w), simulate(deployment(enable_prefix_caching=False), w)
    scheduler = on.instances[0].core.scheduler
    assert scheduler.prefix_cache_queries_total == sum(r.prompt_len for r in w) == 100 * 544
    # every request but each prefix's first finds the prefix's 32 blocks cached (the suffix is its own)
    assert scheduler.prefix_cache_hits_total == 98 * 512
    assert off.instances[0].core.scheduler.prefix_cache_hits_total == 0
    meter = evaluate(deployment(), w).meters["prefix_cache"]
    assert (meter["queried_tokens"], meter["hit_tokens"]) == (100 * 544, 98 * 512)
    assert "prefix_cache" not in evaluate(deployment(enable_prefix_caching=False), w).meters

    def prefill_tokens(result):
        return sum(s.num_prefill_tokens for instance in result.instances for s in instance.step_stats)

    assert prefill_tokens(off) - prefill_tokens(on) == 98 * 512
    ttft = lambda result: sum(r.times.first_token - r.arrival_time for r in result.requests)  # noqa: E731
    assert ttft(on) < ttft(off)
    # with nothing shared, the switch changes nothing
    plain = workload(num_prompts=50)
    assert ([r.times.token_times for r in simulate(deployment(), plain).requests]
            == [r.times.token_times for r in simulate(deployment(enable_prefix_caching=False), plain).requests])
