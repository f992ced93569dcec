"""`servelab lab profile` and `servelab lab validate` end to end on a tiny model: the real engine timed,
a real server streamed to, the profile saved and used by `--gpu local-cpu`, and the comparison's
arithmetic checked against its own figures (the figures themselves depend on this machine's speed). The
engine runs the default model's default mode, int8 weights and int8 KV cache, asked for explicitly (a Hugging
Face folder's --quantization auto keeps float weights)."""
import json
import os
import subprocess
import sys

import pytest

MODE = ["--quantization", "int8", "--kv-cache-dtype", "int8"]
ENGINE_FLAGS = ["--max-num-seqs", "4", "--max-num-batched-tokens", "128", "--num-kv-blocks", "256", *MODE]
# tests/conftest.py TINY_DIMS: 2 layers, K and V of 2 KV heads, rows of head_dim 16 int8 values + a 4-byte scale
INT8_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * (16 + 4)


def servelab(*argv: str, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelab.entrypoints.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def profiled(tiny_llama_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    env = {**os.environ, "SERVELAB_CACHE_DIR": str(cache)}
    out = servelab("lab", "profile", "--model", str(tiny_llama_dir), "--quick", "--repeats", "1", *ENGINE_FLAGS,
                   env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return env, cache / "lab" / "local-cpu.json", out


def test_profile_saves_a_fitted_profile(profiled):
    env, path, out = profiled
    assert f"saved {path}" in out.stdout
    data = json.loads(path.read_text())
    e, fit = data["efficiency"], data["fit"]
    assert data["max_num_seqs"] == 4 and data["max_num_batched_tokens"] == 128
    assert data["dtype"] in ("bfloat16", "float32")
    # the profiled mode, and its pool of 256 blocks in int8 rows
    assert (data["quantization"], data["kv_cache_dtype"]) == ("int8", "int8")
    assert data["kv_cache_bytes"] == 256 * 16 * INT8_KV_BYTES_PER_TOKEN and data["fit"]["num_kv_blocks"] == 256
    assert f"mode: --dtype {data['dtype']} --quantization int8 --kv-cache-dtype int8" in out.stdout
    # the layers curve spans the largest step timed; both curves rise with the count
    assert e["layers_curve"]["x"][-1] >= max(s["tokens"] for s in fit["steps"])
    for curve in (e["layers_curve"], e["lm_head_curve"]):
        assert curve["seconds"] == sorted(curve["seconds"])
    assert e["layers_curve"]["seconds"][-1] > 0
    # every timed step samples one row per request, so the cost of a sampled row and of a request are one
    # column of the fit: it lands in the lm_head curve or in the request overhead, not always the same one
    assert e["lm_head_curve"]["seconds"][-1] > 0 or e["request_overhead_s"] > 0
    assert [p["concurrency"] for p in fit["serving"]["points"]] == [1, 2, 3, 4]  # capped by --max-num-seqs 4
    # each concurrency served in three rounds after a warm-up; the median round is the one kept
    for p in fit["serving"]["points"]:
        assert len(p["tpot_ms_rounds"]) == 3 and p["tpot_ms"] == sorted(p["tpot_ms_rounds"])[1] > 0
    # lone requests' TTFT, less their predicted prefill step, is the arrival overhead
    arrival = fit["serving"]["arrival"]
    assert arrival["ttft_ms"] > 0 and arrival["predicted_prefill_ms"] > 0
    assert e["arrival_overhead_s"] == pytest.approx(max(0.0, (arrival["ttft_ms"] - arrival["predicted_prefill_ms"]) / 1e3))
    assert fit["model_shape"][:3] == [64, 128, 2]  # tests/conftest.py TINY_DIMS: hidden, intermediate, layers
    # KV handoffs between two processes: whole blocks of the tiny model, 1 to 64 of them
    kv = data["kv_transfer"]
    assert kv["bytes_per_block"] == 16 * INT8_KV_BYTES_PER_TOKEN
    assert [b for b, _ in kv["samples"]] == [n * kv["bytes_per_block"] for n in (1, 2, 4, 8, 16, 32, 64)]
    assert all(s > 0 for _, s in kv["samples"]) and kv["bytes_per_s"] > 0 and kv["latency_s"] >= 0
    assert "KV transfer between two processes" in out.stdout


def test_local_cpu_simulates_the_profiled_model_only(profiled, tiny_llama_dir):
    env, _, _ = profiled
    out = servelab("lab", "simulate", "--gpu", "local-cpu", "--model", str(tiny_llama_dir), "--num-prompts", "8",
                   "--input-len", "16", "--output-len", "8", "--json", env=env)
    assert out.returncode == 0, out.stderr
    payload = json.loads(out.stdout)
    assert payload["deployment"]["max_num_seqs"] == 4 and payload["metrics"]["completed"] == 8
    assert payload["profiled_mode"]["quantization"] == "int8" and payload["deployment"]["kv_cache_dtype"] == "int8"
    assert payload["meters"]["kv_cache"]["num_blocks"] == 256  # the profile's bytes in int8 rows
    out = servelab("lab", "simulate", "--gpu", "local-cpu", "--model", "llama-3.1-8b", "--num-prompts", "2", env=env)
    assert out.returncode == 2 and "local-cpu profile was measured with" in out.stderr


def test_validate_compares_real_and_simulated(profiled, tiny_llama_dir, tmp_path):
    env, _, _ = profiled
    # one repeat of two stages keeps the suite inside its budget: the medians over repeats and the profile
    # refresh between them are tested in tests/lab/calibrate/test_validate_repeats.py
    out = servelab("lab", "validate", "--model", str(tiny_llama_dir), "--stages", "continuous,disaggregated",
                   "--max-num-seqs", "4", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                   "--request-rate", "inf", "--repeats", "1", "--json", "--result-dir", str(tmp_path), "--name", "v",
                   env=env)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    payload = json.loads(out.stdout)
    assert [s["stage"] for s in payload["stages"]] == ["3 continuous + paged", "5 disaggregated 1:1"]
    assert payload["repeats"] == 1 and len(payload["profile_fits"]) == 1
    worst = 0.0
    for stage in payload["stages"]:
        real, sim, err = stage["real"], stage["simulated"], stage["error"]
        assert len(stage["runs"]) == len(stage["simulated_runs"]) == 1
        for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            assert real[key] > 0 and sim[key] > 0
            assert err[key] == pytest.approx(sim[key] / real[key] - 1)
            worst = max(worst, abs(err[key]))
    assert payload["max_abs_error"] == pytest.approx(worst)
    assert payload["within_tolerance"] == (worst <= 0.15) and out.returncode == (0 if worst <= 0.15 else 1)
    # both sides run the profiled engine: its mode and its pool
    assert "--quantization int8 --kv-cache-dtype int8" in payload["server_args"]
    assert "--num-kv-blocks 256" in payload["server_args"]
    assert payload["mode"]["quantization"] == "int8" and payload["mode"]["kv_cache_dtype"] == "int8"
    assert (tmp_path / "v" / "v.json").is_file() and (tmp_path / "v" / "v.md").is_file()
