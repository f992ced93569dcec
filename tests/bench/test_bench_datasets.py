"""Prompts for bench serve: the lab's seeded arrivals and lengths, exact prompt lengths, JSONL files."""
import json

import numpy as np
import pytest

from servelab.bench.datasets import build_requests, exact_length_text, ordinary_token_ids, read_jsonl
from servelab.workload import WorkloadConfig, generate_workload


def test_random_ids_have_the_lab_workloads_arrivals_and_lengths(tokenizer):
    config = WorkloadConfig(num_prompts=40, input_len=32, output_len=16, range_ratio=0.5, request_rate=5, seed=3)
    requests = build_requests(config, tokenizer)
    lab = generate_workload(config)
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in requests] == \
           [(s.arrival_time, s.prompt_len, s.output_len) for s in lab]
    vocab = ordinary_token_ids(tokenizer)
    assert vocab.start > max(tokenizer.all_special_ids)
    for r in requests:
        assert len(r.prompt) == r.prompt_len and all(vocab.start <= t < vocab.stop for t in r.prompt)
    assert [r.prompt for r in build_requests(config, tokenizer)] == [r.prompt for r in requests]
    other_seed = build_requests(WorkloadConfig(**{**config.__dict__, "seed": 4}), tokenizer)
    assert [r.prompt for r in other_seed] != [r.prompt for r in requests]
    faster = build_requests(WorkloadConfig(**{**config.__dict__, "request_rate": 50}), tokenizer)
    assert [r.prompt for r in faster] == [r.prompt for r in requests]  # a sweep changes only the arrivals


def test_text_prompts_re_encode_to_exactly_the_sampled_length(tokenizer):
    config = WorkloadConfig(dataset="sharegpt-like", num_prompts=12, request_rate=2, seed=1)
    requests = build_requests(config, tokenizer, prompt_format="text")
    assert [r.prompt_len for r in requests] == [s.prompt_len for s in generate_workload(config)]
    for r in requests:
        assert isinstance(r.prompt, str)
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
    rng = np.random.default_rng(0)
    vocab = ordinary_token_ids(tokenizer)
    for length in (1, 2, 5, 50, 300):
        ids = rng.integers(vocab.start, vocab.stop, size=length).tolist()
        assert len(tokenizer.encode(exact_length_text(ids, tokenizer, vocab, rng), add_special_tokens=False)) == length


def test_jsonl_prompts_cycle_with_seeded_arrivals(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "Hello there", "output_len": 5}), "",
                               json.dumps("Just a string"), json.dumps({"prompt": "Max", "max_tokens": 9})]) + "\n")
    assert read_jsonl(path) == [("Hello there", 5), ("Just a string", None), ("Max", 9)]
    config = WorkloadConfig(num_prompts=5, output_len=11, request_rate=4, seed=2)
    requests = build_requests(config, tokenizer, prompt_format="text", dataset="jsonl", dataset_path=path)
    assert [r.prompt for r in requests] == ["Hello there", "Just a string", "Max", "Hello there", "Just a string"]
    assert [r.output_len for r in requests] == [5, 11, 9, 5, 11]
    assert requests[0].prompt_len == len(tokenizer.encode("Hello there", add_special_tokens=False))
    assert [r.arrival_time for r in requests] == [s.arrival_time for s in generate_workload(
        WorkloadConfig(num_prompts=5, input_len=64, output_len=8, request_rate=4, seed=2))]
    ids = build_requests(config, tokenizer, prompt_format="ids", dataset="jsonl", dataset_path=path)
    assert ids[0].prompt == tokenizer.encode("Hello there", add_special_tokens=False)


@pytest.mark.parametrize("text, message", [
    ("not json\n", "not JSON"), ('{"text": "x"}\n', "prompt"), ('{"prompt": "x", "output_len": 0}\n', "output_len"),
    ("\n", "no prompts"),
])
def test_bad_jsonl_lines_say_where(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)
    with pytest.raises(ValueError, match="no such file"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_prefix_shared_prompts_share_their_groups_prefix(tokenizer):
    config = WorkloadConfig(dataset="prefix-shared", num_prompts=12, prefix_len=40, num_prefixes=2, input_len=8,
                            output_len=4, seed=5)
    requests = build_requests(config, tokenizer)
    groups = [s.prefix_group for s in generate_workload(config)]
    prefixes = {}
    for r, group in zip(requests, groups):
        assert len(r.prompt) == r.prompt_len == 48
        assert prefixes.setdefault(group, r.prompt[:40]) == r.prompt[:40]
    assert len(prefixes) == 2 and prefixes[0] != prefixes[1]
    assert len({tuple(r.prompt[40:]) for r in requests}) == 12  # every suffix its own
