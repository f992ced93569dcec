"""The CPU profile that `--gpu local-cpu` reads: format, location, loading, and a simulation with it."""
import json

import pytest

from servelab.executor.efficiency import Efficiency
from servelab.executor.curve import PiecewiseLinear
from servelab.lab.catalog import LOCAL_CPU, get_device, get_model
from servelab.specs import DeviceSpec
from servelab.lab.cli import main
from servelab.lab.catalog.cpu_profile import (PROFILE_FORMAT, CpuProfile, load_cpu_profile, model_shape, profile_path,
                                  save_cpu_profile)


def make_profile() -> CpuProfile:
    device = DeviceSpec(id=LOCAL_CPU, name="test CPU (2 cores)", flops=60e9, memory_bandwidth=12e9,
                        memory_bytes=8 << 30, interconnect="none", interconnect_bandwidth=0.0, network_bandwidth=0.0,
                        gpus_per_node=1, source="")
    efficiency = Efficiency(matmul=1.0, attention=0.4, memory=1.0, kv_memory=0.6, interconnect=1.0,
                            allreduce_latency_s=0.0, step_overhead_s=2e-3, request_overhead_s=1e-4,
                            layers_curve=PiecewiseLinear((1, 2, 64), (0.020, 0.030, 0.300)),
                            lm_head_curve=PiecewiseLinear((1, 64), (0.004, 0.090)))
    return CpuProfile(device, efficiency, kv_cache_bytes=2 << 30, dtype="bfloat16", max_num_seqs=128,
                      max_num_batched_tokens=1024, fit={"model": "smollm2-135m", "num_samples": 3,
                                                                 "model_shape": model_shape(get_model("smollm2-135m"))},
                      created="2025-01-01T00:00:00", host="test")


def test_location_roundtrip_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    assert profile_path() == tmp_path / "lab" / "local-cpu.json"
    with pytest.raises(ValueError, match="run `servelab lab profile` first"):
        get_device(LOCAL_CPU)
    saved = save_cpu_profile(make_profile())
    data = json.loads(saved.read_text())
    assert data["format"] == PROFILE_FORMAT and data["version"] == 2 and data["device"]["flops"] == 60e9
    loaded = load_cpu_profile()
    assert loaded.efficiency == make_profile().efficiency and loaded.device.memory_bytes == 8 << 30
    data["version"] = 99
    saved.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version-2"):
        load_cpu_profile()


def test_local_cpu_simulation_uses_the_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())
    code = main(["simulate", "--model", "smollm2-135m", "--gpu", LOCAL_CPU, "--num-prompts", "20",
                 "--input-len", "64", "--output-len", "16", "--request-rate", "0.2", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["deployment"]["max_num_seqs"] == 128
    # the profile's 2 GiB pool: 2 GiB / (23040 bytes per token * 16)
    assert payload["meters"]["kv_cache"]["num_blocks"] == (2 << 30) // (23040 * 16)
    # decode steps of one request (the rate is low): the curves' 20 + 4 ms, plus overheads and attention
    assert 26.1 < payload["metrics"]["median_tpot_ms"] < 27


def test_local_cpu_refuses_a_model_it_did_not_measure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())
    code = main(["simulate", "--model", "llama-3.1-8b", "--gpu", LOCAL_CPU, "--num-prompts", "2"])
    assert code == 2 and "measured with smollm2-135m, not Llama-3.1-8B" in capsys.readouterr().err


def test_kv_transfer_figures_round_trip_and_are_required_for_stage_5(tmp_path, monkeypatch):
    from dataclasses import replace

    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())
    with pytest.raises(ValueError, match="no KV-transfer figures"):
        load_cpu_profile().kv_transfer_link
    kv = {"latency_s": 2e-4, "bytes_per_s": 1.5e9, "bytes_per_block": 368640, "samples": [[368640, 5e-4]]}
    save_cpu_profile(replace(make_profile(), kv_transfer=kv))
    assert load_cpu_profile().kv_transfer_link == (2e-4, 1.5e9)


def test_stage_5_simulation_prices_the_measured_link_on_shared_cores():
    from dataclasses import replace

    from servelab.lab.calibrate.validate import shared_cores, simulated_metrics
    from servelab.workload import WorkloadConfig

    e = shared_cores(make_profile().efficiency, 2)
    assert e.layers_curve.ys == (0.040, 0.060, 0.600) and e.lm_head_curve.ys == (0.008, 0.180)
    assert e.attention == 0.2 and e.kv_memory == 0.3 and e.step_overhead_s == 2e-3
    spec = get_model("smollm2-135m")
    config = WorkloadConfig(num_prompts=12, input_len=64, output_len=8, request_rate=0.2, seed=0)
    fast = replace(make_profile(), kv_transfer={"latency_s": 0.0, "bytes_per_s": 1e12})
    slow = replace(make_profile(), kv_transfer={"latency_s": 1.0, "bytes_per_s": 1e12})
    m_fast = simulated_metrics(fast, spec, "disaggregated", 8, config)
    m_slow = simulated_metrics(slow, spec, "disaggregated", 8, config)
    # the first token comes from the prefill instance; the handoff delays the second one by its latency
    assert m_slow["median_ttft_ms"] == pytest.approx(m_fast["median_ttft_ms"])
    assert m_slow["median_e2el_ms"] - m_fast["median_e2el_ms"] == pytest.approx(1000, abs=1)
    colocated = simulated_metrics(fast, spec, "continuous", 8, config)
    # each instance runs on half the cores: its prefill step takes about twice as long
    assert m_fast["median_ttft_ms"] > 1.5 * colocated["median_ttft_ms"]


def test_the_step_grid_keeps_each_shapes_median_round(monkeypatch):
    # served steps run at the machine's typical speed, and `lab validate` compares with the median of real
    # runs: a shape's fastest round (a quiet moment) would price every simulated step too fast
    from types import SimpleNamespace

    from servelab.lab.calibrate import step_timing

    # a warm-up step, then round after round over the two shapes
    seconds = iter([9.0, 3.0, 1.0, 1.0, 5.0, 2.0, 4.0])
    grid = [[(0, 1, True)], [(0, 2, True)]]

    class Timer:
        def __init__(self, *args):
            pass

        def time(self, shape):
            return next(seconds)

    monkeypatch.setattr(step_timing, "StepTimer", Timer)
    monkeypatch.setattr(step_timing, "step_grid", lambda settings, quick: grid)
    scheduler = SimpleNamespace(effective_max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64)
    engine = SimpleNamespace(config=SimpleNamespace(scheduler=scheduler, cache=SimpleNamespace(block_size=16),
                                                    model=SimpleNamespace(vocab_size=10)),
                             executor=SimpleNamespace(num_blocks=8))
    samples = step_timing.measure_steps(engine, repeats=3)
    assert [s.seconds for s in samples] == [2.0, 4.0]  # the medians of (3, 1, 2) and (1, 5, 4)
