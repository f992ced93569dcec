"""`servelab bench serve` and `bench sweep` from the command line against the fake server: the result
JSON (vLLM's keys), the markdown table and the plots."""
import json
import math

from fake_openai_server import MODEL, FakeOpenAIServer, Plan

from servelab.entrypoints.cli import main

VLLM_SUMMARY_KEYS = [
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "errors", "model_id", "tokenizer_id",
    "num_prompts", "request_rate", "burstiness", "max_concurrency",
] + [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]


def test_bench_serve_writes_vllms_result_json_table_and_plots(tmp_path, default_model_dir, capsys):
    with FakeOpenAIServer(lambda body: Plan(ttft_s=0.05, itl_s=0.01)) as server:
        rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "4", "--request-rate", "50", "--seed", "1", "--goodput", "ttft:1000", "tpot:500",
                   "--tokenizer", str(default_model_dir), "--result-dir", str(tmp_path), "--name", "run",
                   "--result-file", str(tmp_path / "copy.json"), "--disable-tqdm"])
    assert rc == 0
    assert len(server.bodies) == 7  # a short test request first, as vllm bench serve sends
    assert all(len(b["prompt"]) == 8 and isinstance(b["prompt"][0], int) for b in server.bodies)
    result = json.loads((tmp_path / "run" / "run.json").read_text())
    assert json.loads((tmp_path / "copy.json").read_text()) == result
    missing = [k for k in VLLM_SUMMARY_KEYS if k not in result]
    assert not missing
    assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == MODEL
    assert result["goodput"] == result["request_goodput"] and result["goodput_share"] == 1.0
    assert result["output_lens"] == [4] * 6 and result["request_rate"] == 50
    for name in ("run.md", "ttft_cdf.png", "tpot_cdf.png", "tokens_per_s.png"):
        assert (tmp_path / "run" / name).stat().st_size > 0
    assert "| Successful requests | 6 |" in (tmp_path / "run" / "run.md").read_text()
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s):" in out


def test_bench_serve_bad_input_is_one_line(tmp_path, default_model_dir, capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--goodput", "ttft",
                 "--tokenizer", str(default_model_dir)]) == 2
    assert "--goodput" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--tokenizer", str(default_model_dir),
                 "--result-dir", str(tmp_path)]) == 2
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err


def test_bench_sweep_rates_and_search(tmp_path, default_model_dir):
    common = ["--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--tokenizer", str(default_model_dir),
              "--result-dir", str(tmp_path), "--disable-tqdm"]
    with FakeOpenAIServer(lambda body: Plan(ttft_s=0.02, itl_s=0.01)) as server:
        assert main(["bench", "sweep", "--base-url", server.url, "--request-rates", "40,inf", "--name", "list",
                     *common]) == 0
        assert main(["bench", "sweep", "--base-url", server.url, "--search", "--goodput", "ttft:2000",
                     "--min-rate", "20", "--max-rate", "40", "--name", "search", *common]) == 0
    listed = json.loads((tmp_path / "list" / "list.json").read_text())
    assert [p["request_rate"] for p in listed["points"]] == [40, "inf"]
    assert all(p["completed"] == 3 and "ttfts" not in p for p in listed["points"])
    assert (tmp_path / "list" / "sweep.png").stat().st_size > 0
    searched = json.loads((tmp_path / "search" / "search.json").read_text())
    assert searched["best_request_rate"] == 40 and [p["request_rate"] for p in searched["points"]] == [20, 40]
    assert all(p["goodput_share"] == 1.0 for p in searched["points"])
    assert "| req/s offered |" in (tmp_path / "search" / "search.md").read_text()
    assert not math.isnan(searched["points"][0]["output_throughput"])
