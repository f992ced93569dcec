"""servelab bench perplexity: the scoring rule (llama-perplexity's) and the shipped text."""
import math

import pytest
import torch

from servelab.bench.perplexity import TEXT, chunk_nll, chunks, llama_cpp_perplexity


def test_chunk_nll_scores_the_second_half():
    vocab, ids = 10, [1, 2, 3, 4, 5, 6, 7, 8]
    logits = torch.zeros(len(ids), vocab)
    nll, n = chunk_nll(logits, ids)
    assert n == 3  # predictions from positions 4, 5, 6 of tokens 5, 6, 7 (0-based: tokens at 5..7)
    assert nll == pytest.approx(3 * math.log(vocab))
    logits[5, ids[6]] = 100.0  # a certain prediction costs nothing
    assert chunk_nll(logits, ids)[0] == pytest.approx(2 * math.log(vocab))


def test_chunks_need_two_contexts():
    assert chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="needs 8"):
        chunks(list(range(7)), 4)


def test_the_public_domain_text_ships():
    text = TEXT.read_text(encoding="utf-8")
    assert text.startswith("In Congress, July 4, 1776.")
    assert "shall not perish from the earth." in text


def test_llama_cpp_output_is_parsed(tmp_path):
    fake = tmp_path / "llama-perplexity"
    fake.write_text("#!/bin/sh\necho '[1]12.5,[2]13.0,'\necho 'Final estimate: PPL = 12.3456 +/- 0.42' >&2\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 10)
    row = llama_cpp_perplexity(fake, gguf, TEXT, 512, 2)
    assert row["perplexity"] == 12.3456 and row["weight_bytes"] == 10


def test_step_tokens_outside_the_chunk_is_refused(capsys):
    from servelab.entrypoints.cli import main

    with pytest.raises(SystemExit, match=r"--step-tokens must be between 1 and --ctx \(64\), got 0"):
        main(["bench", "perplexity", "--ctx", "64", "--step-tokens", "0", "--precisions", "float32"])
