"""`bench serve --trace` against a real servelab server (tiny model, 127.0.0.1): each format's requests arrive with
the trace's lengths, and a Mooncake trace's shared hash_ids are prefix-cache hits, counted exactly by the server."""
import json

import pytest
from servelab.testing.server import TINY_ENGINE_FLAGS, metric_values

from servelab.entrypoints.cli import main

FILES = {
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,40,3\n"
             "2023-11-16 18:15:46.7805900,25,2\n",
    "burstgpt": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                "0,ChatGPT,30,3,33,Conversation log\n1,ChatGPT,12,0,12,Conversation log\n1,GPT-4,20,2,22,x\n",
    # one 512-token block each (the tiny model's context is 512): requests 2 and 3 start with request 1's block
    "mooncake": "".join(json.dumps(r) + "\n" for r in (
        {"timestamp": 0, "input_length": 400, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 1500, "input_length": 300, "output_length": 2, "hash_ids": [7]},
        {"timestamp": 3000, "input_length": 100, "output_length": 2, "hash_ids": [8]})),
}
LENGTHS = {"azure": [40, 25], "burstgpt": [30, 20], "mooncake": [400, 300, 100]}


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--max-num-seqs", "4")


@pytest.mark.parametrize("fmt", ["azure", "burstgpt", "mooncake"])
def test_each_trace_format_replays_against_the_server(server, tmp_path, tiny_llama_dir, fmt):
    trace = tmp_path / f"trace.{fmt}"
    trace.write_text(FILES[fmt])
    before = metric_values(server.url)
    rc = main(["bench", "serve", "--base-url", server.url, "--trace", str(trace), "--trace-format", fmt,
               "--time-scale", "0.5", "--ignore-eos", "--tokenizer", str(tiny_llama_dir), "--result-dir",
               str(tmp_path), "--name", fmt, "--disable-tqdm", "--seed", str(list(FILES).index(fmt))])
    assert rc == 0
    result = json.loads((tmp_path / fmt / f"{fmt}.json").read_text())
    after = metric_values(server.url)
    assert result["completed"] == len(LENGTHS[fmt]) and result["failed"] == 0
    assert result["input_lens"] == LENGTHS[fmt]
    if fmt == "mooncake":
        # the load generator's test request is request 1 (25 full blocks): request 1 then finds 24 of them (a
        # prompt's last token is always computed), request 2 its first 18; each format's own seed keeps the
        # other formats' random prompts from sharing a block with these
        hits = after["servelab:prefix_cache_hits_total"] - before["servelab:prefix_cache_hits_total"]
        assert hits == (24 + 18) * 16
