"""Requests for `servelab bench serve`: the lab's seeded workload (arrivals and lengths, see
lab/workload.py) made into prompts a server can run.

`random` and `sharegpt-like` prompts are random ordinary token ids of the sampled length; `prefix-shared`
prompts are one of the workload's random prefixes followed by a random suffix of their own. They go to
/v1/completions as token ids (exact length, works against servelab and vLLM), or, for chat endpoints
and servers without token-id prompts, as text decoded with the model's tokenizer and re-encoded until
it has exactly the sampled length. `jsonl` reads prompts from a file, one JSON object per line:
{"prompt": "...", "output_len": 128} (output_len, or max_tokens, is optional), or a bare JSON string.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servelab.trace_formats import MOONCAKE_BLOCK_TOKENS
from servelab.workload import DEFAULT_OUTPUT_LEN, WorkloadConfig, block_hash_prompt, generate_workload
from servelab.model.tokenizer import Tokenizer

BENCH_DATASETS = ("random", "sharegpt-like", "prefix-shared", "jsonl")
PROMPT_FORMATS = ("ids", "text")
MAX_LENGTH_FIXES = 16


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    arrival_time: float  # seconds after the benchmark starts


def load_tokenizer(model_or_path: str | Path | None) -> Tokenizer:
    """The tokenizer of a model folder, a .gguf file, or (None) the default model."""
    from servelab.model.model_path import resolve_model_path  # torch-free: the client never imports torch

    return Tokenizer.from_pretrained(resolve_model_path(model_or_path))


def ordinary_token_ids(tokenizer: Tokenizer) -> range:
    # The special tokens sit at the start of the vocabulary (as in bench throughput).
    return range(max(tokenizer.all_special_ids, default=-1) + 1, tokenizer.vocab_size)


def build_requests(config: WorkloadConfig, tokenizer: Tokenizer, prompt_format: str = "ids",
                   dataset: str | None = None, dataset_path: Path | None = None) -> list[BenchRequest]:
    """dataset: None or config.dataset for the seeded lengths; "jsonl" reads dataset_path and takes only
    the arrivals from the seeded workload (the same arrivals as `random` with the same flags)."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt format must be one of {', '.join(PROMPT_FORMATS)}, got {prompt_format!r}")
    if (dataset or config.dataset) == "jsonl":
        if dataset_path is None:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return _jsonl_requests(config, tokenizer, Path(dataset_path), prompt_format)
    workload = generate_workload(config)
    # A third stream of the same seed: the arrival and length streams stay those of `lab simulate`.
    rng = np.random.default_rng(np.random.SeedSequence(config.seed).spawn(3)[2])
    vocab = ordinary_token_ids(tokenizer)
    prefixes = {}  # prefix group -> its token ids, drawn when first needed
    blocks: dict[int, list[int]] = {}  # a trace's block hash id -> its tokens, drawn when first needed

    def block_tokens(h: int) -> list[int]:
        if h not in blocks:
            blocks[h] = rng.integers(vocab.start, vocab.stop, size=MOONCAKE_BLOCK_TOKENS).tolist()
        return blocks[h]

    requests = []
    for sampled in workload:
        if sampled.block_hash_ids:
            ids = block_hash_prompt(sampled.block_hash_ids, sampled.prompt_len, block_tokens)
        elif sampled.prefix_group is None:
            ids = rng.integers(vocab.start, vocab.stop, size=sampled.prompt_len).tolist()
        else:
            prefix = prefixes.get(sampled.prefix_group)
            if prefix is None:
                prefix = prefixes[sampled.prefix_group] = rng.integers(vocab.start, vocab.stop,
                                                                       size=sampled.prefix_len).tolist()
            ids = prefix + rng.integers(vocab.start, vocab.stop, size=sampled.prompt_len - sampled.prefix_len).tolist()
        prompt: list[int] | str = ids
        if prompt_format == "text":
            prompt = exact_length_text(ids, tokenizer, vocab, rng)
        requests.append(BenchRequest(prompt, sampled.prompt_len, sampled.output_len, sampled.arrival_time))
    return requests


def exact_length_text(ids: list[int], tokenizer: Tokenizer, vocab: range, rng: np.random.Generator) -> str:
    """Text that re-encodes to exactly len(ids) tokens: decoding random ids and encoding them again
    merges or splits some, so cut or top up the re-encoded ids and try again."""
    length = len(ids)
    for _ in range(MAX_LENGTH_FIXES):
        text = tokenizer.decode(ids)
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == length:
            return text
        ids = again[:length] if len(again) > length else again + rng.integers(
            vocab.start, vocab.stop, size=length - len(again)).tolist()
    raise ValueError(f"could not build a text prompt of exactly {length} tokens with {tokenizer.name}")


def read_jsonl(path: Path) -> list[tuple[str, int | None]]:
    """(prompt, output length or None) per non-empty line."""
    if not path.is_file():
        raise ValueError(f"--dataset-path {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err.msg})") from None
        if isinstance(item, str):
            item = {"prompt": item}
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: expected a non-empty string or an object with a \"prompt\" string")
        output_len = item.get("output_len", item.get("max_tokens"))
        if output_len is not None and (not isinstance(output_len, int) or output_len < 1):
            raise ValueError(f"{path}:{number}: output_len must be a positive integer, got {output_len!r}")
        rows.append((prompt, output_len))
    if not rows:
        raise ValueError(f"{path} has no prompts")
    return rows


def _jsonl_requests(config: WorkloadConfig, tokenizer: Tokenizer, path: Path,
                    prompt_format: str) -> list[BenchRequest]:
    rows = read_jsonl(path)
    arrivals = [r.arrival_time for r in generate_workload(
        WorkloadConfig(num_prompts=config.num_prompts, input_len=1, output_len=1,
                       request_rate=config.request_rate, burstiness=config.burstiness, seed=config.seed))]
    requests = []
    for i, arrival in enumerate(arrivals):  # the file's prompts in order, again from the top if it is short
        text, output_len = rows[i % len(rows)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        output_len = output_len or config.output_len or DEFAULT_OUTPUT_LEN
        requests.append(BenchRequest(ids if prompt_format == "ids" else text, len(ids), output_len, arrival))
    return requests
