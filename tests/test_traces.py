"""Public trace formats (Azure CSV, BurstGPT CSV, Mooncake JSONL) read exactly, shaped by the replay flags, and
replayed by `lab simulate`: a Mooncake trace's shared hash_ids are shared cached blocks."""
import json

import pytest

from servelab.errors import FieldError
from servelab.lab.cli import main
from servelab.trace_formats import read_trace
from servelab.workload import WorkloadConfig, generate_workload


def write_azure(path):
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,396,109\n"
                    "2023-11-16 18:15:47.0000000,879,1\n")
    return path


def write_burstgpt(path):
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "5,ChatGPT,472,18,490,Conversation log\n"
                    "45,GPT-4,1087,0,1087,Conversation log\n"
                    "118,ChatGPT,417,217,634,Conversation log\n")
    return path


def write_mooncake(path):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
            {"timestamp": 500, "input_length": 1024, "output_length": 10, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]},
            {"timestamp": 2500, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_format_reads_exactly(tmp_path):
    azure = read_trace(write_azure(tmp_path / "a.csv"), "azure")
    assert [(r.prompt_len, r.output_len) for r in azure] == [(374, 44), (879, 1), (396, 109)]  # by arrival
    assert [round(r.arrival_time, 6) for r in azure] == [0.0, 0.31941, 4.314579]
    burst = read_trace(write_burstgpt(tmp_path / "b.csv"), "burstgpt")
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in burst] == [(0.0, 472, 18), (113.0, 417, 217)]
    moon = read_trace(write_mooncake(tmp_path / "m.jsonl"), "mooncake")
    assert [r.arrival_time for r in moon] == [0.0, 0.5, 1.5, 2.5]
    assert [r.block_hash_ids for r in moon] == [(0, 1, 2), (0, 1), (0, 3), (4, 5)]


def test_bad_files_say_where(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,Tokens\n1,2\n")
    with pytest.raises(ValueError, match="missing column"):
        read_trace(bad, "azure")
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="bad.csv:1: 1 hash_ids for 600 tokens"):
        read_trace(bad, "mooncake")
    with pytest.raises(FieldError):
        generate_workload(WorkloadConfig(trace=str(tmp_path / "none.csv"), trace_format="azure"))
    with pytest.raises(FieldError):
        WorkloadConfig(trace=str(bad))
    with pytest.raises(FieldError):
        WorkloadConfig(time_scale=2.0)


def test_time_scale_max_requests_and_sample(tmp_path):
    path = str(write_mooncake(tmp_path / "m.jsonl"))
    fast = generate_workload(WorkloadConfig(trace=path, trace_format="mooncake", time_scale=0.5))
    assert [w.arrival_time for w in fast] == [0.0, 0.25, 0.75, 1.25]
    assert [w.prompt_len for w in generate_workload(
        WorkloadConfig(trace=path, trace_format="mooncake", max_requests=2))] == [1100, 1024]
    sampled = generate_workload(WorkloadConfig(trace=path, trace_format="mooncake", sample=2, seed=1))
    assert len(sampled) == 2 and sampled[0].arrival_time == 0.0
    assert sampled == generate_workload(WorkloadConfig(trace=path, trace_format="mooncake", sample=2, seed=1))


def test_simulate_replays_each_format_and_mooncake_blocks_hit_the_prefix_cache(tmp_path, capsys):
    base = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100", "--json"]
    for fmt, writer in (("azure", write_azure), ("burstgpt", write_burstgpt), ("mooncake", write_mooncake)):
        path = writer(tmp_path / f"t.{fmt}")
        assert main([*base, "--trace", str(path), "--trace-format", fmt]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["metrics"]["completed"] == len(read_trace(path, fmt))
        assert out["workload"]["trace_format"] == fmt
    # arrivals 0.5 s apart finish one after the other on an H100, so every shared block is cached when the
    # next request comes: request 2 finds blocks 0-1 (1024 tokens), request 3 block 0 (512), request 4 none
    prefix = out["meters"]["prefix_cache"]
    assert prefix["queried_tokens"] == 1100 + 1024 + 700 + 600
    # the scheduler leaves a prompt's last token to compute: request 2's 1024 shared tokens hit 1008 of them
    assert prefix["hit_tokens"] == 1008 + 512
