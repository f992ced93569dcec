"""`bench serve --trace`: a Mooncake trace's prompts share exactly the token blocks its hash_ids share."""
import json

from servelab.bench.datasets import build_requests
from servelab.workload import WorkloadConfig


def test_mooncake_prompts_share_the_blocks_their_hash_ids_share(tmp_path, tokenizer):
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [7, 8, 9]},
            {"timestamp": 250, "input_length": 1024, "output_length": 3, "hash_ids": [7, 8]},
            {"timestamp": 1000, "input_length": 600, "output_length": 2, "hash_ids": [7, 3]},
            {"timestamp": 2000, "input_length": 100, "output_length": 2, "hash_ids": [8]}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = WorkloadConfig(trace=str(path), trace_format="mooncake", time_scale=2.0)
    requests = build_requests(config, tokenizer)
    assert [r.arrival_time for r in requests] == [0.0, 0.5, 2.0, 4.0]
    assert [len(r.prompt) for r in requests] == [r.prompt_len for r in requests] == [1100, 1024, 600, 100]
    assert [r.output_len for r in requests] == [4, 3, 2, 2]
    a, b, c, d = (r.prompt for r in requests)
    assert b == a[:1024] and c[:512] == a[:512] and c[512:] != a[512:600]
    assert d == a[512:612]  # block 8 is the same tokens wherever it appears
    assert requests[0].prompt == build_requests(config, tokenizer)[0].prompt  # seeded
