"""The CPU profile that `--gpu local-cpu` reads: format, location, loading, and a simulation with it."""
import json

import pytest

from servelab.executor.cost_model import Efficiency
from servelab.lab.catalog import LOCAL_CPU, DeviceSpec, get_device
from servelab.lab.cli import main
from servelab.lab.profile import PROFILE_FORMAT, CpuProfile, load_cpu_profile, profile_path, save_cpu_profile


def make_profile() -> CpuProfile:
    device = DeviceSpec(id=LOCAL_CPU, name="test CPU (2 cores)", flops=60e9, memory_bandwidth=12e9,
                        memory_bytes=8 << 30, interconnect="none", interconnect_bandwidth=0.0, network_bandwidth=0.0,
                        gpus_per_node=1, source="")
    efficiency = Efficiency(matmul=1.0, attention=0.4, memory=1.0, kv_memory=0.6, interconnect=1.0,
                            ring_step_latency_s=0.0, step_overhead_s=2e-3, request_overhead_s=1e-4)
    return CpuProfile(device, efficiency, kv_cache_bytes=2 << 30, dtype="bfloat16", max_num_seqs=128,
                      max_num_batched_tokens=1024, fit={"model": "smollm2-135m", "num_samples": 3},
                      created="2025-01-01T00:00:00", host="test")


def test_location_roundtrip_and_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    assert profile_path() == tmp_path / "lab" / "local-cpu.json"
    with pytest.raises(ValueError, match="run `servelab lab profile` first"):
        get_device(LOCAL_CPU)
    saved = save_cpu_profile(make_profile())
    data = json.loads(saved.read_text())
    assert data["format"] == PROFILE_FORMAT and data["version"] == 1 and data["device"]["flops"] == 60e9
    loaded = load_cpu_profile()
    assert loaded.efficiency == make_profile().efficiency and loaded.device.memory_bytes == 8 << 30
    data["version"] = 99
    saved.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version-1"):
        load_cpu_profile()


def test_local_cpu_simulation_uses_the_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    save_cpu_profile(make_profile())
    code = main(["simulate", "--model", "smollm2-135m", "--gpu", LOCAL_CPU, "--num-prompts", "20",
                 "--input-len", "64", "--output-len", "16", "--request-rate", "2", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["deployment"]["max_num_seqs"] == 128
    # the profile's 2 GiB pool: 2 GiB / (23040 bytes per token * 16)
    assert payload["meters"]["kv_cache"]["num_blocks"] == (2 << 30) // (23040 * 16)
    # a 135M model in bf16 reads 269 MB per step at 12 GB/s: tens of milliseconds per token
    assert 20 < payload["metrics"]["median_tpot_ms"] < 60
