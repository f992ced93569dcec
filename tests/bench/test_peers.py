"""`servelab bench peers` without building llama.cpp: the workloads, the roofline functions, the
build and run command lines, the missing-toolchain error, and the table and plot from a fake result."""
import json
import math
import os
import stat

import pytest
from fake_openai_server import FakeOpenAIServer, Plan

from servelab.bench.peers import llama_cpp_build as build
from servelab.bench.peers import llama_cpp_runs as runs_mod
from servelab.bench.peers.command import (add_roofline_shares, build_workloads, parse_only, parse_quantization,
                                          result_name)
from servelab.bench.peers.runs import online_run
from servelab.bench.peers.report import parse_lscpu, table_rows, write_peers
from servelab.bench.peers.roofline import (gemm_seconds, int8_gemm_seconds, linear_shapes, measure_roofline,
                                     read_bandwidth_gbs)
from servelab.entrypoints.cli import main

SMOLLM2_CONFIG = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152}


def test_workloads_are_seeded_and_poisson_reuses_the_burst_requests(tokenizer):
    work = build_workloads(tokenizer, num_online=12, num_offline=20, seed=3)
    assert work == build_workloads(tokenizer, num_online=12, num_offline=20, seed=3)
    assert work.burst != build_workloads(tokenizer, num_online=12, num_offline=20, seed=4).burst
    assert [(r.prompt_len, r.output_len, r.arrival_time) for r in work.burst] == [(128, 64, 0.0)] * 12
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 128 for r in work.burst)
    assert [r.prompt for r in work.poisson] == [r.prompt for r in work.burst]
    arrivals = [r.arrival_time for r in work.poisson]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0 and len(set(arrivals)) == 12
    assert all(64 <= r.prompt_len <= 256 and 32 <= r.output_len <= 128 and len(r.prompt) == r.prompt_len
               for r in work.offline)
    assert len({r.prompt_len for r in work.offline}) > 5 and work.decode_tokens == 64


def test_every_server_peer_is_sent_exactly_the_same_requests(tokenizer):
    work = build_workloads(tokenizer, num_online=5, num_offline=5, seed=0)
    sent = {}
    for peer in ("llama.cpp", "servelab"):
        with FakeOpenAIServer(lambda body: Plan(ttft_s=0.001, itl_s=0.0, num_chunks=3)) as server:
            run = online_run("burst", "burst", peer, peer, "cfg", server.url, "m", work.burst, tokenizer, False)
        assert run["completed"] == 5 and run["failed"] == 0 and run["peer"] == peer and "itls" not in run
        bodies = server.bodies[1:]  # the first is the probe request
        sent[peer] = sorted((b["prompt"], b["max_tokens"], b["ignore_eos"], b["temperature"]) for b in bodies)
    assert sent["llama.cpp"] == sent["servelab"]
    assert sent["servelab"] == sorted((r.prompt, 64, True, 0.0) for r in work.burst)


def test_roofline_functions_return_positive_finite_numbers():
    shapes = linear_shapes(SMOLLM2_CONFIG)
    assert shapes["qkv_proj"] == (576, 960, 30) and shapes["down_proj"] == (1536, 576, 30)
    assert shapes["lm_head"] == (576, 49152, 1)
    for seconds in (gemm_seconds(4, 16, 8, min_time_s=0.003), int8_gemm_seconds(4, 16, 8, min_time_s=0.003)):
        assert 0 < seconds < 1
    assert 0 < read_bandwidth_gbs(1 << 20, min_time_s=0.003) < math.inf
    tiny = {"a": (16, 32, 2), "b": (32, 8, 1)}
    roofline = measure_roofline(tiny, ms=(2, 4), min_time_s=0.003, bandwidth_bytes=1 << 20)
    kinds = [p["kind"] for p in roofline["gemm"]]
    assert kinds[:2] == ["fp32", "fp32"] and kinds[-2:] == ["int8", "int8"]
    for point in roofline["gemm"]:
        assert point["m"] in (2, 4) and set(point["per_shape"]) == {"a", "b"}
        assert all(0 < v < math.inf for v in [point["gflops"], *point["per_shape"].values()])


def test_sdist_download_configure_and_build_command_lines(tmp_path):
    download = build.download_command("0.3.36", tmp_path)
    assert download[1:] == ["-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                            "llama-cpp-python==0.3.36", "--dest", str(tmp_path)]
    configure = build.configure_command(tmp_path / "src", tmp_path / "build")
    assert configure[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    for option in ("-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DCMAKE_BUILD_TYPE=Release"):
        assert option in configure
    assert build.build_command(tmp_path / "build", 2) == [
        "cmake", "--build", str(tmp_path / "build"), "--config", "Release", "-j2",
        "--target", "llama-server", "llama-bench", "llama-perplexity", "llama-quantize"]


def test_llama_cpp_run_command_lines(tmp_path):
    tools = build.LlamaCppTools(tmp_path)
    server = runs_mod.server_command(tools, tmp_path / "m.gguf", 8123, 64, 256, 2, "llama.cpp")
    flags = dict(zip(server[1::2], server[2::2]))
    assert server[0] == str(tmp_path / "llama-server") and server[-1] == "--no-webui"
    assert flags["--parallel"] == "64" and flags["-c"] == str(64 * 256) and flags["-fa"] == "on"
    assert flags["-t"] == flags["-tb"] == "2" and flags["--port"] == "8123" and flags["--cache-ram"] == "0"
    assert runs_mod.bench_command(tools, tmp_path / "m.gguf", 64, 2, 5)[1:] == [
        "-m", str(tmp_path / "m.gguf"), "-p", "0", "-n", "64", "-t", "2", "-fa", "on", "-r", "5", "-o", "json"]
    assert runs_mod.quantize_command(tools, tmp_path / "a.gguf", tmp_path / "b.gguf", "Q8_0", 2)[1:] == [
        "--allow-requantize", str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf"), "Q8_0", "2"]
    assert [runs_mod.slot_context(n) for n in (10, 256, 257, 700)] == [256, 256, 512, 1024]
    parsed = runs_mod.parse_bench_json(json.dumps([{"avg_ts": 120.5, "stddev_ts": 1.5, "n_gen": 64, "n_threads": 2,
                                                    "model_type": "llama ?B Q4_1", "build_commit": "abc"}]))
    assert parsed["tokens_per_s"] == 120.5 and parsed["n_gen"] == 64 and parsed["build_commit"] == "abc"
    with pytest.raises(ValueError, match="one llama-bench test"):
        runs_mod.parse_bench_json("[]")


def test_missing_cmake_or_compiler_names_the_package(tmp_path, monkeypatch, capsys):
    with pytest.raises(build.BuildError, match=r"cmake \(apt-get install cmake"):
        build.check_toolchain(lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    with pytest.raises(build.BuildError, match=r"C\+\+ compiler \(apt-get install g\+\+"):
        build.check_toolchain(lambda name: "/usr/bin/cmake" if name == "cmake" else None)
    build.check_toolchain(lambda name: f"/usr/bin/{name}")
    # From the command line: one line, before any download, nothing left in the cache.
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    assert main(["bench", "peers", "--only", "llama.cpp", "--result-dir", str(tmp_path / "out")]) == 2
    # one error line (another test's background thread may have logged to stderr around it)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("servelab: error:")]
    assert len(errors) == 1 and errors[0].startswith("servelab: error: building llama.cpp needs cmake")
    assert "apt-get install cmake" in errors[0]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def _fake_tools(bin_dir):
    bin_dir.mkdir(parents=True)
    for tool in build.TOOLS:
        (bin_dir / tool).write_text("#!/bin/sh\n")
        (bin_dir / tool).chmod(stat.S_IRWXU)


def test_a_finished_build_is_reused_and_skip_build_needs_one(tmp_path, monkeypatch, capsys):
    root = tmp_path / "llama.cpp-x"
    _fake_tools(root / "build" / "bin")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # no toolchain needed to reuse
    assert build.ensure_llama_cpp("x", root=root).bin_dir == root / "build" / "bin"
    assert "reusing the build" in capsys.readouterr().out
    assert build.existing_tools(root).bin_dir == root / "build" / "bin"
    os.remove(root / "build" / "bin" / "llama-bench")
    with pytest.raises(build.BuildError, match="no llama-server, llama-bench"):
        build.existing_tools(root)
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "empty"))
    assert main(["bench", "peers", "--skip-build", "--only", "llama.cpp"]) == 2
    assert "--skip-build: no finished llama.cpp build" in capsys.readouterr().err


def test_a_build_that_dies_of_sigill_gives_way_to_the_build_without_amx(tmp_path, monkeypatch, capsys):
    """The first build's llama-bench dies of an illegal instruction (as ggml's AMX kernels do on some VMs): the
    no-AMX build is used, and says why; a variant that runs is used as it is."""
    root = tmp_path / "llama.cpp-x"
    _fake_tools(root / "build" / "bin")
    (root / "build" / "bin" / "llama-bench").write_text("#!/bin/sh\nkill -ILL $$\n")
    _fake_tools(root / "build-noamx" / "bin")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # both reused: nothing is built
    tools = build.ensure_llama_cpp("x", root=root, gguf=tmp_path / "m.gguf")
    assert tools.bin_dir == root / "build-noamx" / "bin" and tools.build.startswith("native without AMX")
    assert "dies with SIGILL" in capsys.readouterr().out
    assert build.ensure_llama_cpp("x", root=root).bin_dir == root / "build" / "bin"  # no model: not tried
    (root / "build" / "bin" / "llama-bench").write_text("#!/bin/sh\nexit 3\n")  # another failure: not SIGILL
    assert build.ensure_llama_cpp("x", root=root, gguf=tmp_path / "m.gguf").build == "native"
    assert "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in build.configure_command(
        tmp_path, tmp_path / "b", build.VARIANTS[1][1])


def test_flags_parse():
    assert parse_only("hf, servelab") == ["hf", "servelab"]
    with pytest.raises(ValueError, match="--only"):
        parse_only("servelab,vllm")
    assert result_name("smoke") == "peers-smoke" and result_name("peers-x") == "peers-x"
    assert parse_quantization("none, int8,gguf") == [(None, "auto"), ("int8", "auto"), ("gguf", "auto")]
    assert parse_quantization("default") == [("auto", "auto")]
    assert parse_quantization("int8+kv-int8,none+kv-int8") == [("int8", "int8"), (None, "int8")]
    with pytest.raises(ValueError, match="--quantization takes .* from default, none, gguf, int8, each .* got .awq."):
        parse_quantization("awq")
    with pytest.raises(ValueError, match=r"got .int8\+kv-fp8."):
        parse_quantization("int8+kv-fp8")


def _fake_result() -> dict:
    ttfts = [0.1, 0.2, 0.4]
    online = dict(completed=3, failed=0, duration=2.0, median_ttft_ms=200.0, p99_ttft_ms=398.0,
                  median_tpot_ms=20.0, start_times=[0, 0.5, 1], ttfts=ttfts, errors=["", "", ""])
    runs = [{"workload": "burst", "kind": "burst", "peer": "llama.cpp", "engine": "llama.cpp",
             "config": "Q4_1 GGUF, 16 slots", "output_throughput": 300.0, **online},
            {"workload": "burst", "kind": "burst", "peer": "servelab", "engine": "servelab", "config": "serve",
             "output_throughput": 250.0, **online},
            {"workload": "poisson", "kind": "poisson", "peer": "servelab", "engine": "servelab", "config": "serve",
             "output_throughput": 90.0, **online},
            {"workload": "offline", "kind": "offline", "peer": "hf", "engine": "hf transformers",
             "config": "generate", "output_throughput": 80.0, "completed": 3, "failed": 0, "duration": 4.0},
            {"workload": "decode", "kind": "decode", "peer": "llama.cpp", "engine": "llama.cpp",
             "config": "Q8_0 GGUF, llama-bench", "output_throughput": 50.0, "weight_bytes": 200_000_000},
            {"workload": "decode", "kind": "decode", "peer": "servelab", "engine": "servelab",
             "config": "batch 1", "output_throughput": 20.0, "weight_bytes": 400_000_000}]
    roofline = {"gemm": [{"kind": k, "m": m, "gflops": g * m, "per_shape": {}}
                         for k, g in (("fp32", 1.0), ("int8", 2.0)) for m in (32, 128, 512)],
                "read_bandwidth_gbs": 20.0, "bandwidth_buffer_bytes": 1 << 30, "torch_threads": 2}
    add_roofline_shares(runs, roofline["read_bandwidth_gbs"])
    return {"model": "M", "cpu": {"model_name": "Test CPU", "num_cpus": 2, "key_flags": ["avx2", "fma"]},
            "roofline": roofline, "runs": runs, "command": "servelab bench peers"}


def test_table_json_and_plot_from_a_fake_result(tmp_path):
    result = _fake_result()
    assert result["runs"][4]["roofline_tokens_per_s"] == pytest.approx(100.0)
    assert result["runs"][5]["roofline_share"] == pytest.approx(0.4)
    rows = table_rows(result["runs"])
    assert rows[0]["ok/failed"] == "3/0" and rows[0]["TTFT p99 ms"] == 398.0
    assert rows[3]["TTFT p99 ms"] == "-" and rows[4]["% of BW roofline"] == "50%" and rows[4]["ok/failed"] == "-"
    json_path, md_path = write_peers("peers-test", result, tmp_path / "peers-test")
    saved = json.loads(json_path.read_text())
    assert saved["runs"] == result["runs"] and saved["cpu"]["model_name"] == "Test CPU" and "machine" in saved
    md = md_path.read_text()
    assert "| workload | engine | config | output tok/s |" in md
    assert "| burst | llama.cpp | Q4_1 GGUF, 16 slots | 300.00 |" in md
    assert "Test CPU, 2 CPUs; flags: avx2 fma" in md and "Read bandwidth: 20.0 GB/s" in md
    assert "| int8 | 64.00 | 256.00 | 1,024.00 |" in md
    png = (tmp_path / "peers-test" / "peers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_parse_lscpu():
    text = "Architecture: x86_64\nCPU(s):   4\nModel name:  AMD EPYC 9R14\nFlags: fpu avx2 fma avx512f avx512_bf16\n"
    assert parse_lscpu(text) == {"model_name": "AMD EPYC 9R14", "num_cpus": 4,
                                 "key_flags": ["avx2", "fma", "avx512f", "avx512_bf16"], "num_flags": 5}


def test_servelab_offline_loops_drive_a_real_engine_to_the_end():
    """generate_offline / servelab_decode (the offline and decode rows) on a real LLMEngine over the stub executor:
    every request runs to its length and the engine ends empty, with every block free."""
    from servelab.testing.stub_engine import make_engine

    from servelab.bench.datasets import BenchRequest
    from servelab.bench.peers.runs import generate_offline, servelab_decode

    engine = make_engine(num_blocks=64, max_num_seqs=4)
    requests = [BenchRequest([2] * (3 + i), 3 + i, 4 + i, 0.0) for i in range(6)]
    assert generate_offline(engine, requests, "t") > 0
    assert not engine.has_unfinished_requests()
    assert servelab_decode(engine, num_tokens=5, num_iters=2, prompt_token_id=2) > 0
    state = engine.get_state()
    assert state.num_running == state.num_waiting == 0 and state.num_free_blocks == state.num_blocks == 64


def test_servelab_decodes_a_given_gguf_file_for_the_same_weights_row(tmp_path, tiny_llama_dir):
    """The row beside each llama-bench GGUF: servelab loads that file with --quantization gguf (here the tiny
    random-weight Llama written as a Q8_0 GGUF with gguf-py, the block format llama-quantize writes for llama.cpp's
    Q8_0 copy of the default model) and reports its stored size."""
    import sys
    import types
    from pathlib import Path

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    from servelab.bench.peers.runs import run_servelab_gguf_decode
    from servelab.bench.peers.workloads import Workloads

    sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
    from test_loader import write_tiny_gguf  # a GGUF laid out as llama.cpp's converter writes one (F32)

    config = json.loads((tiny_llama_dir / "config.json").read_text())
    reader = GGUFReader(write_tiny_gguf(tmp_path / "tiny.gguf", load_file(str(tiny_llama_dir / "model.safetensors")),
                                        config))
    out = tmp_path / "tiny.Q8_0.gguf"
    writer = GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if
                                 field.types[0] == field.types[0].ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2:  # the matrices in 8-bit blocks, the norms as they are (F32)
            writer.add_tensor(t.name, quantize(data, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    work = Workloads([], [], [], 4, {"decode": "decode batch 1 (tg4)"})
    row = run_servelab_gguf_decode(types.SimpleNamespace(threads=None, quick=True), work, out, "Q8_0")
    assert row["config"].endswith("--quantization gguf, Q8_0 GGUF") and row["output_throughput"] > 0
    tensors = GGUFReader(out).tensors  # the blocks as stored; the float32 norms held in bf16
    assert {t.tensor_type for t in tensors} == {GGMLQuantizationType.Q8_0, GGMLQuantizationType.F32}
    assert row["weight_bytes"] == sum(int(t.n_bytes) if t.tensor_type != GGMLQuantizationType.F32
                                      else int(t.n_elements) * 2 for t in tensors)
