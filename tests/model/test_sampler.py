from __future__ import annotations

import math

import pytest
import torch

from servelab.model.sampler import Sampler, SamplingRow
from servelab.sampling_params import SamplingParams

VOCAB = 64


def row(prompt=(1, 2, 3), output=(), **kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), list(prompt), list(output))


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    return [t.token_id for t in Sampler()(logits, rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(32).to(dtype)
    rows = [row(temperature=0.0) for _ in range(32)]
    out = Sampler()(logits, rows)
    assert [t.token_id for t in out] == logits.float().argmax(dim=-1).tolist()
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_does_not_modify_input_logits():
    logits = random_logits(3)
    before = logits.clone()
    Sampler()(logits, [row(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0, output=[4, 5]),
                       row(temperature=0.8, top_k=5, seed=1), row(temperature=1.0, min_p=0.2)])
    assert torch.equal(logits, before)


def test_non_contiguous_input():
    wide = random_logits(4, vocab=VOCAB + 8)
    logits = wide[:, :VOCAB]  # e.g. a vocab padded for sharding, sliced back
    rows = [row(output=[1, 1], temperature=0.0, frequency_penalty=0.5, logprobs=1), row(temperature=0.5, seed=2),
            row(temperature=0.0), row(temperature=1.0, top_k=3, seed=4)]
    got = Sampler()(logits, rows)
    want = Sampler()(logits.contiguous(), rows)
    assert [t.token_id for t in got] == [t.token_id for t in want]
    assert got[0].top_logprobs == want[0].top_logprobs


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, logprobs=3),
    dict(temperature=0.7, seed=11, top_k=8),
    dict(temperature=1.3, seed=12, top_p=0.8, presence_penalty=0.5),
    dict(temperature=1.0, seed=13, min_p=0.1, logprobs=0),
    dict(temperature=0.9, seed=14, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2, logprobs=5),
    dict(temperature=1.0, seed=15),
]


def mixed_rows() -> list[SamplingRow]:
    return [row(prompt=[i, 7, 9], output=[i + 1, 3, 3], **kw) for i, kw in enumerate(MIXED)]


def test_mixed_batch_matches_each_row_alone():
    logits, rows = random_logits(len(MIXED)), mixed_rows()
    batch = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        (alone,) = Sampler()(logits[i : i + 1], [r])
        assert batch[i].token_id == alone.token_id, i
        if alone.logprob is None:
            assert batch[i].logprob is None and batch[i].top_logprobs is None
            continue
        assert batch[i].logprob == pytest.approx(alone.logprob, abs=1e-6)
        assert [t for t, _ in batch[i].top_logprobs] == [t for t, _ in alone.top_logprobs]
        assert [v for _, v in batch[i].top_logprobs] == pytest.approx([v for _, v in alone.top_logprobs], abs=1e-6)


def test_seeded_rows_reproducible_across_batch_order_and_steps():
    logits = random_logits(8, vocab=1000)
    rows = [row(output=[5] * i, temperature=1.5, seed=100 + i) for i in range(8)]
    first = token_ids(logits, rows)
    assert token_ids(logits, rows) == first
    perm = [3, 7, 0, 5, 1, 6, 2, 4]
    permuted = token_ids(logits[perm], [rows[i] for i in perm])
    assert permuted == [first[i] for i in perm]
    # Inside a bigger batch with unseeded neighbours (a preempted request recomputing the same step).
    neighbours = random_logits(5, vocab=1000, seed=1)
    big = token_ids(torch.cat([neighbours, logits]), [row(temperature=1.0) for _ in range(5)] + rows)
    assert big[5:] == first
    # The draw depends on the step: same seed and logits, different output lengths, not all equal.
    same_logits = logits[:1].expand(16, -1)
    steps = token_ids(same_logits, [row(output=[5] * s, temperature=5.0, seed=7) for s in range(16)])
    assert len(set(steps)) > 1


@pytest.mark.parametrize("knob", [dict(top_k=1), dict(top_p=1e-6), dict(top_p=1e-9), dict(min_p=1.0)])
def test_truncation_to_one_token_is_greedy(knob):
    logits = random_logits(200, seed=3)
    assert token_ids(logits, [row(temperature=1.0, **knob) for _ in range(200)]) == logits.argmax(-1).tolist()


def chi_square(samples: list[int], expected_probs: torch.Tensor) -> float:
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected_probs)).double()
    expected = expected_probs.double() * n
    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token of probability zero"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


# chi-square critical values at p = 0.001 for df = 1..5
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
BASE = torch.tensor([2.0, 1.5, 0.5, 0.0, -1.0, 1.0])
NUM_DRAWS = 4000


def draw(knobs: dict, seeded: bool) -> list[int]:
    logits = BASE.expand(NUM_DRAWS, -1)
    if seeded:
        rows = [row(seed=s, **knobs) for s in range(NUM_DRAWS)]
    else:
        torch.manual_seed(1234)
        rows = [row(**knobs) for _ in range(NUM_DRAWS)]
    return token_ids(logits, rows)


@pytest.mark.parametrize("seeded", [True, False])
def test_temperature_distribution_matches_softmax(seeded):
    expected = (BASE / 0.7).softmax(-1)
    stat = chi_square(draw(dict(temperature=0.7), seeded), expected)
    assert stat < CRITICAL[5]


def truncated(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    probs = torch.zeros(len(BASE))
    probs[keep] = (BASE[keep] / temperature).softmax(-1)
    return probs


@pytest.mark.parametrize(
    "knobs, keep",
    [
        (dict(top_k=3), [0, 1, 5]),
        # probs ~ [.42 .25 .09 .06 .02 .15]: cumulative descending .42 .68 .83 -> top_p .7 keeps three
        (dict(top_p=0.7), [0, 1, 5]),
        (dict(top_p=0.6), [0, 1]),
        # min_p .3 of max .42 = .13 keeps probs >= .12
        (dict(min_p=0.3), [0, 1, 5]),
        # top_p applies to what top_k kept, renormalised: [.51 .31 .19] reaches .55 with two
        (dict(top_k=3, top_p=0.55), [0, 1]),
        # after top_k=4 the smallest prob is .10 of max .46, just above min_p .2
        (dict(top_k=4, top_p=0.99, min_p=0.2), [0, 1, 5, 2]),
    ],
)
def test_truncated_distribution(knobs, keep):
    stat = chi_square(draw(knobs, seeded=True), truncated(keep))
    assert stat < CRITICAL[len(keep) - 1]


def penalised_logprobs(values: list[float], prompt: list[int], output: list[int], **penalties) -> list[float]:
    """Logprobs are taken after penalties, so they expose the penalised logits exactly."""
    r = SamplingRow(SamplingParams(temperature=0.0, logprobs=len(values), **penalties), prompt, output)
    (out,) = Sampler()(torch.tensor([values]), [r])
    by_id = dict(out.top_logprobs)
    return [by_id[i] for i in range(len(values))]


def expect(values: list[float]) -> list[float]:
    return pytest.approx(torch.tensor(values).log_softmax(-1).tolist(), abs=1e-6)


def test_repetition_penalty():
    # positive logits divided, negative multiplied; prompt and output both count, once each
    got = penalised_logprobs([2.0, 1.9, -1.0, -1.1, 0.5], repetition_penalty=1.25, prompt=[0, 0], output=[2, 2])
    assert got == expect([1.6, 1.9, -1.25, -1.1, 0.5])
    assert token_ids(torch.tensor([[2.0, 1.9]]), [row(prompt=[0], temperature=0.0, repetition_penalty=1.25)]) == [1]
    assert token_ids(torch.tensor([[-1.0, -1.1]]), [row(prompt=[], output=[0], temperature=0.0,
                                                         repetition_penalty=1.25)]) == [1]
    # a penalty below 1 rewards repeats
    assert token_ids(torch.tensor([[1.9, 2.0]]), [row(prompt=[0], temperature=0.0, repetition_penalty=0.9)]) == [0]


def test_frequency_penalty_counts_output_only():
    got = penalised_logprobs([3.0, 2.5, 0.0], frequency_penalty=0.3, prompt=[1, 1, 1], output=[0, 0, 2])
    assert got == expect([2.4, 2.5, -0.3])
    once = row(prompt=[], output=[0], temperature=0.0, frequency_penalty=0.3)
    twice = row(prompt=[], output=[0, 0], temperature=0.0, frequency_penalty=0.3)
    assert token_ids(torch.tensor([[3.0, 2.5]] * 2), [once, twice]) == [0, 1]


def test_presence_penalty_counts_once():
    got = penalised_logprobs([3.0, 2.5, 0.0], presence_penalty=0.4, prompt=[1], output=[0, 0, 0])
    assert got == expect([2.6, 2.5, 0.0])
    rows = [row(prompt=[], output=[0, 0, 0], temperature=0.0, presence_penalty=p) for p in (0.4, 0.6, -0.6)]
    assert token_ids(torch.tensor([[3.0, 2.5]] * 3), rows) == [0, 1, 0]


def test_penalties_combine_in_vllm_order():
    got = penalised_logprobs([2.0, -1.0, 1.0], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                             prompt=[2], output=[0, 0, 1])
    # token 0: 2/2 - 0.5*2 - 0.25 ; token 1: -1*2 - 0.5 - 0.25 ; token 2: prompt only -> 1/2
    assert got == expect([-0.25, -2.75, 0.5])


def test_logprobs_values_and_order():
    logits = random_logits(3, seed=5)
    rows = [row(temperature=0.0, logprobs=5), row(temperature=0.8, seed=3, top_k=4, logprobs=2), row(logprobs=None)]
    out = Sampler()(logits, rows)
    reference = logits.log_softmax(-1)
    for i in (0, 1):
        assert out[i].logprob == pytest.approx(reference[i, out[i].token_id].item(), abs=1e-6)
        values, ids = reference[i].topk(rows[i].params.logprobs)
        assert [t for t, _ in out[i].top_logprobs] == ids.tolist()
        assert [v for _, v in out[i].top_logprobs] == pytest.approx(values.tolist(), abs=1e-6)
    assert out[0].top_logprobs[0][0] == out[0].token_id
    assert out[2].logprob is None and out[2].top_logprobs is None
    (zero,) = Sampler()(logits[:1], [row(temperature=0.0, logprobs=0)])
    assert zero.top_logprobs == [] and zero.logprob == pytest.approx(reference[0].max().item(), abs=1e-6)


def test_bfloat16_input_matches_float32():
    logits = random_logits(len(MIXED), seed=9).to(torch.bfloat16)
    batch = Sampler()(logits, mixed_rows())
    reference = Sampler()(logits.float(), mixed_rows())
    assert [t.token_id for t in batch] == [t.token_id for t in reference]
    assert batch[1].logprob == reference[1].logprob and math.isfinite(batch[1].logprob)


def _bitmask(allowed_per_row: list[list[int]], vocab: int = VOCAB) -> torch.Tensor:
    import numpy as np

    bits = np.zeros((len(allowed_per_row), -(-vocab // 32) * 32), dtype=np.uint8)
    for i, allowed in enumerate(allowed_per_row):
        bits[i, allowed] = 1
    return torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_grammar_bitmask_limits_each_constrained_row(temperature):
    from servelab.sampling_params import StructuredOutputsParams

    grammar = StructuredOutputsParams("regex", "a")
    logits = random_logits(3)
    before = logits.clone()
    rows = [row(temperature=temperature, seed=i, structured_outputs=grammar if i != 1 else None) for i in range(3)]
    allowed = [[3, 17], list(range(VOCAB)), [VOCAB - 1]]
    for _ in range(5):
        tokens = [t.token_id for t in Sampler()(logits, rows, _bitmask(allowed))]
        assert tokens[0] in (3, 17) and tokens[2] == VOCAB - 1
    assert torch.equal(logits, before)
    if temperature == 0.0:
        assert tokens[1] == logits[1].argmax().item()
        assert tokens[0] == (3 if logits[0, 3] > logits[0, 17] else 17)


def test_logit_bias_and_logprobs_of_the_model():
    logits = random_logits(1)
    target = int(logits[0].argmin())
    out = Sampler()(logits, [row(temperature=0.0, logit_bias={target: 100.0}, logprobs=1)])[0]
    assert out.token_id == target
    assert math.isclose(out.logprob, logits[0].float().log_softmax(-1)[target].item(), rel_tol=1e-5)
