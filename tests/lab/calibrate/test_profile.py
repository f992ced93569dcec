"""The CPU profile that `--gpu local-cpu` reads: format, location, loading, and a simulation with it."""
import json
from dataclasses import replace

import pytest

from servelab.engine_args import EngineArgs
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
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())
    with pytest.raises(ValueError, match="no KV-transfer figures"):
        load_cpu_profile().kv_transfer_link
    kv = {"latency_s": 2e-4, "bytes_per_s": 1.5e9, "bytes_per_block": 368640, "samples": [[368640, 5e-4]]}
    save_cpu_profile(replace(make_profile(), kv_transfer=kv))
    assert load_cpu_profile().kv_transfer_link == (2e-4, 1.5e9)


def test_stage_5_simulation_prices_the_measured_link_on_shared_cores():
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


# ---- the engine mode a profile measures (weights and KV cache dtype)

def test_an_int8_kv_profile_gives_the_engines_blocks_for_the_same_bytes(tiny_llama_dir):
    """The lab turns the profile's KV bytes into blocks as the engine turns its KV memory into blocks: an int8
    cache row is head_dim int8 values and an fp32 scale."""
    from servelab.engine.llm_engine import LLMEngine
    from servelab.executor.model_executor import kv_cache_bytes

    spec = get_model(str(tiny_llama_dir))
    for kv_cache_dtype in ("int8", "auto"):
        args = EngineArgs(model=str(tiny_llama_dir), quantization="none", kv_cache_dtype=kv_cache_dtype,
                          kv_cache_memory=0.002)
        engine = LLMEngine.from_engine_args(args)
        profile = replace(make_profile(), kv_cache_bytes=kv_cache_bytes(engine.config.cache), dtype=engine.config.dtype,
                          kv_cache_dtype=kv_cache_dtype, fit={"block_size": engine.config.cache.block_size})
        assert profile.num_kv_blocks(spec) == engine.executor.num_blocks
        cache = engine.executor.kv_caches[0]  # (K and V, blocks, block slots, KV heads, row)
        per_token = spec.num_hidden_layers * cache[:, 0, 0].numel() * cache.element_size()
        assert spec.kv_bytes_per_token(profile.kv_dtype) == per_token
    # the default model: 30 layers x K and V x 3 KV heads x (64 values + 4 scale bytes), against 2 bytes each
    smollm = get_model("smollm2-135m")
    assert smollm.kv_bytes_per_token("int8") == 12240 and smollm.kv_bytes_per_token("bfloat16") == 23040


def test_validate_serves_the_profiled_mode():
    from servelab.lab.calibrate.validate import profile_server_args

    spec = get_model("smollm2-135m")
    profile = replace(make_profile(), quantization="int8", kv_cache_dtype="int8", fit={"block_size": 16})
    assert profile_server_args(profile, spec) == (
        "--dtype bfloat16 --quantization int8 --kv-cache-dtype int8 --max-num-batched-tokens 1024 "
        f"--block-size 16 --num-kv-blocks {(2 << 30) // (12240 * 16)}")
    assert "--quantization none --kv-cache-dtype auto" in profile_server_args(make_profile(), spec)


def test_a_profile_without_the_mode_loads_as_float(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    path = save_cpu_profile(replace(make_profile(), quantization="int8", kv_cache_dtype="int8"))
    data = json.loads(path.read_text())
    assert (data["quantization"], data["kv_cache_dtype"]) == ("int8", "int8")
    assert (load_cpu_profile().quantization, load_cpu_profile().kv_cache_dtype) == ("int8", "int8")
    del data["quantization"], data["kv_cache_dtype"]  # as profiles measured before the fields were
    path.write_text(json.dumps(data))
    old = load_cpu_profile()
    assert (old.quantization, old.kv_cache_dtype, old.kv_dtype) == ("none", "auto", "bfloat16")
    assert old.num_kv_blocks(get_model("smollm2-135m")) == (2 << 30) // (23040 * 16)


def test_local_cpu_simulation_prices_and_reports_the_profiled_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(replace(make_profile(), quantization="int8", kv_cache_dtype="int8"))
    flags = ["simulate", "--model", "smollm2-135m", "--gpu", LOCAL_CPU, "--num-prompts", "4", "--input-len", "64",
             "--output-len", "8"]
    assert main([*flags, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["profiled_mode"] == {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8",
                                        "flags": "--dtype bfloat16 --quantization int8 --kv-cache-dtype int8"}
    assert payload["deployment"]["kv_cache_dtype"] == "int8"
    assert payload["meters"]["kv_cache"]["num_blocks"] == (2 << 30) // (12240 * 16)  # int8 rows and their scales
    assert main(flags) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "mode: --dtype bfloat16 --quantization int8 --kv-cache-dtype int8 (the local-cpu profile's engine)"


def test_profile_resolves_auto_as_serve_does(monkeypatch):
    import servelab.kernels
    from servelab.lab.calibrate.profile_run import profiled_engine_args

    monkeypatch.setattr(servelab.kernels, "cpu_ops", lambda: object())  # the kernels built
    mode = lambda **kw: (lambda a: (a.quantization, a.kv_cache_dtype))(profiled_engine_args(EngineArgs(**kw)))  # noqa: E731
    assert mode() == ("int8", "int8")  # the default model's default mode
    assert mode(kv_cache_dtype="int8", quantization="none") == ("none", "int8")  # asked for: kept
    assert mode(dtype="float32") == ("none", "auto")  # --dtype asks for float weights
    monkeypatch.setattr(servelab.kernels, "cpu_ops", lambda: None)
    assert mode() == ("none", "auto")  # no kernels: serve runs float weights, so the profile does
