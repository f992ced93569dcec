"""End to end against real servelab servers with the tiny model: `bench serve` (token-id and chat
prompts, cross-checked with the server's own counters) and `bench stages` (three servers, one table)."""
import json

import pytest
from servelab.testing.server import TINY_ENGINE_FLAGS, metric_values

from servelab.bench import stages
from servelab.entrypoints.cli import main

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 16, 8


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--max-num-seqs", "4")


def bench_serve(server, tmp_path, name, tokenizer_dir, *flags):
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", str(NUM_PROMPTS), "--input-len",
               str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--request-rate", "30", "--ignore-eos",
               "--tokenizer", str(tokenizer_dir), "--result-dir", str(tmp_path), "--name", name, "--disable-tqdm",
               *flags])
    assert rc == 0
    return json.loads((tmp_path / name / f"{name}.json").read_text())


def test_bench_serve_token_ids_against_servelab(server, tmp_path, tiny_llama_dir):
    before = metric_values(server.url)
    result = bench_serve(server, tmp_path, "ids", tiny_llama_dir)
    after = metric_values(server.url)
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["error_counts"]
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS and result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["model_id"] == tiny_llama_dir.name
    # the server counted the same tokens (plus the 4-token test request)
    served = lambda key: after[f"servelab:{key}_total"] - before[f"servelab:{key}_total"]  # noqa: E731
    assert served("prompt_tokens") == (NUM_PROMPTS + 1) * INPUT_LEN
    assert served("generation_tokens") == NUM_PROMPTS * OUTPUT_LEN + 4
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] < result["p99_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0


def test_bench_serve_chat_text_prompts(server, tmp_path, tiny_llama_dir):
    result = bench_serve(server, tmp_path, "chat", tiny_llama_dir, "--endpoint", "/v1/chat/completions")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["error_counts"]
    assert result["backend"] == "openai-chat" and result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(n > INPUT_LEN for n in result["input_lens"])  # the server's count includes the chat template


def test_bench_stages_runs_each_stage_on_its_own_server(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    started = []

    class Recorded(stages.ServelabServer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(stages, "ServelabServer", Recorded)
    rc = main(["bench", "stages", "--model", str(tiny_llama_dir), "--num-prompts", "4", "--input-len", "16",
               "--output-len", "6", "--range-ratio", "0", "--request-rate", "inf", "--max-num-seqs", "2",
               "--stages", "serial,static,continuous",  # the tiny model's 4 heads do not split by stage 4's 3
               f"--server-args={' '.join(TINY_ENGINE_FLAGS)}", "--result-dir", str(tmp_path), "--name", "st",
               "--baseline", "hf", "--disable-tqdm"])
    assert rc == 0
    assert len(started) == 3 and all(s.proc.poll() is not None for s in started)
    result = json.loads((tmp_path / "st" / "st.json").read_text())
    assert [r["schedule"] for r in result["runs"]] == ["serial", "static", "continuous", "hf"]
    assert result["runs"][3]["completed"] == 4 and result["continuous_vs_hf_output_throughput"] > 0
    for run in result["runs"][:3]:
        assert run["completed"] == 4 and run["failed"] == 0 and run["output_lens"] == [6] * 4
        assert run["server_flags"][:2] == ["--schedule", run["schedule"]]
    assert result["runs"][0]["max_concurrent_requests"] == 4  # the client sends all; the server serializes
    assert "continuous_vs_serial_output_throughput" in result and "continuous_vs_static_p99_ttft" in result
    table = (tmp_path / "st" / "st.md").read_text()
    assert "| 1 serial |" in table and "| hf transformers float32 static batch 2 (offline) |" in table
    assert "| 1 serial |" in table and "| 2 static batching (max-num-seqs 2) |" in table
    for name in ("stages.png", "ttft_cdf.png", "tpot_cdf.png", "tokens_per_s.png"):
        assert (tmp_path / "st" / name).stat().st_size > 0
    assert "continuous_vs_static_output_throughput" in capsys.readouterr().out
