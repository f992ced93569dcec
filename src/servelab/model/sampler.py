"""Turns a batch of next-token logits into sampled tokens, each row with its own SamplingParams."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from servelab.core.plan import SampledToken
from servelab.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step's token


def _row_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a seeded row's draw depends only on its seed and output length,
    so it is the same whatever else is in the batch and after preemption by recompute."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _index(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """Row indices as a tensor, or None when they are all rows (so no gather/copy is needed)."""
    return None if len(rows) == num_rows else torch.tensor(rows, dtype=torch.long, device=device)


def _take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return x if idx is None else x.index_select(0, idx)


def _keys(token_lists: list[list[int]], row_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Flat indices row * vocab_size + token into a (num_rows, vocab_size) tensor."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long, device=device), lengths)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return rows * vocab_size + tokens


def apply_penalties_(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's penalties, in place on contiguous float32 logits (num_rows, vocab): repetition over
    prompt and output, then frequency and presence over the output. Only the (row, token) pairs
    that occur are touched, so the cost follows the number of tokens, not rows x vocab."""
    device, vocab_size = logits.device, logits.shape[1]
    penalty_rows = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    penalised = [rows[i] for i in penalty_rows]
    output_keys = _keys([r.output_token_ids for r in penalised], penalty_rows, vocab_size, device)
    output_keys, output_counts = output_keys.unique(return_counts=True)
    prompt_keys = _keys([r.prompt_token_ids for r in penalised], penalty_rows, vocab_size, device)
    seen_keys = torch.cat([output_keys, prompt_keys]).unique()

    def per_key(values: list[float], keys: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[keys // vocab_size]

    flat = logits.view(-1)
    seen = flat[seen_keys]
    repetition = per_key([r.params.repetition_penalty for r in rows], seen_keys)
    flat[seen_keys] = torch.where(seen > 0, seen / repetition, seen * repetition)
    frequency = per_key([r.params.frequency_penalty for r in rows], output_keys)
    presence = per_key([r.params.presence_penalty for r in rows], output_keys)
    flat[output_keys] = flat[output_keys] - frequency * output_counts - presence


def _sorted_values(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        # torch's CPU sort always builds indices and is ~10x slower than numpy's SIMD value sort.
        return torch.from_numpy(np.sort(x.numpy(), axis=-1))
    return x.sort(dim=-1).values


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax; like torch's, the first maximum wins and NaN counts as the maximum."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # torch's CPU argmax is a scalar loop, ~5x (1 row) to ~10x (32 rows) slower than numpy's.
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens kept by top-k then top-p, with one ascending sort of all rows as in vLLM. top_k
    (num_rows,) with 0 = off, top_p (num_rows,). A row keeps the tokens at or above a probability
    threshold, so ties with the last kept token stay and the most likely token always survives."""
    vocab_size = probs.shape[1]
    probs_sort = _sorted_values(probs)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp_(max=vocab_size)
    probs_sort = probs_sort * (probs_sort >= probs_sort.gather(1, (vocab_size - k).unsqueeze(1)))
    # Drop the low tail holding <= 1 - p of the mass top-k kept: what stays is the smallest set
    # reaching p. The tail is a prefix of the ascending order, so its length is a count.
    cumulative = probs_sort.cumsum(dim=-1)
    tail = cumulative <= (1 - top_p).unsqueeze(1) * cumulative[:, -1:]
    first_kept = tail.sum(dim=-1, keepdim=True).clamp_(max=vocab_size - 1)
    return probs >= probs_sort.gather(1, first_kept)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draws one token per row from unnormalised probs (num_rows, vocab) by inverting the CDF with
    one uniform (num_rows, 1) each: a cumsum and a binary search, instead of a random number per
    vocabulary entry (the serial RNG was ~8 ms per step for 32 rows x 49k tokens)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    # The first token whose cumulative mass passes u * total; its own mass is > 0 because the cdf
    # rises there. When rounding puts u * total at the total, take the last token with mass.
    token = torch.searchsorted(cdf, uniform * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(token, last).squeeze(1)


def plain_greedy(rows: list[SamplingRow]) -> bool:
    """Every row takes its logits' argmax and nothing else (no temperature, penalties, logprobs, logit bias or
    grammar): its token is all a step needs from the logits (ModelExecutor then asks the model for argmaxes,
    where it has them cheaper)."""
    return all(r.params.temperature < 1e-5 and r.params.logprobs is None and not r.params.needs_penalties
               and not r.params.shapes_logits for r in rows)


# Added to a forbidden token's logit: finite (so no inf - inf), and exp() of it minus any logit is 0.
_FORBIDDEN_LOGIT = -3.0e38


def forbid_tokens_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on float32 logits (num_rows, vocab): push down every token a row's bitmask does not allow. The
    int32 bitmask (num_rows, ceil(vocab / 32)) allows token t where bit t of its row is set (llguidance's and
    xgrammar's layout)."""
    vocab_size = logits.shape[1]
    if bitmask.device.type == "cpu":
        # Branchless: a masked_fill over a patchy mask costs ~7x this add on a CPU (64 x 49k: 20 ms vs 3 ms).
        bits = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
        logits.add_(torch.from_numpy(bits[:, :vocab_size]).to(torch.float32), alpha=_FORBIDDEN_LOGIT)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size]
    logits.masked_fill_(allowed == 0, float("-inf"))


def shape_logits_(logits: torch.Tensor, rows: list[SamplingRow], grammar_bitmask: torch.Tensor | None) -> None:
    """In place on float32 logits: add each row's logit bias, then forbid the tokens its grammar does not
    allow. grammar_bitmask has one row per logits row (all bits set where a row has no grammar)."""
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            ids = torch.tensor(list(r.params.logit_bias), dtype=torch.long, device=logits.device)
            logits[i].index_add_(0, ids, torch.tensor(list(r.params.logit_bias.values()), dtype=logits.dtype,
                                                      device=logits.device))
    if grammar_bitmask is None:
        return
    constrained = [i for i, r in enumerate(rows) if r.params.structured_outputs is not None]
    if not constrained:
        return
    idx = _index(constrained, logits.shape[0], logits.device)
    if idx is None:
        forbid_tokens_(logits, grammar_bitmask)
    else:
        rows_logits = logits.index_select(0, idx)
        forbid_tokens_(rows_logits, _take(grammar_bitmask, idx))
        logits.index_copy_(0, idx, rows_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 grammar_bitmask: torch.Tensor | None = None) -> list[SampledToken]:
        """logits (num_rows, vocab) in the model dtype; one SampledToken per row, in order. grammar_bitmask
        (num_rows, ceil(vocab / 32)) int32, when some rows follow a grammar: their allowed next tokens."""
        params = [r.params for r in rows]
        if plain_greedy(rows):
            return [SampledToken(t) for t in _argmax(logits).tolist()]

        num_rows, device = logits.shape[0], logits.device
        needs_penalties = any(p.needs_penalties for p in params)
        shapes_logits = any(p.shapes_logits for p in params)
        logits = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=needs_penalties or shapes_logits)
        if needs_penalties:
            apply_penalties_(logits, rows)
        model_logits = logits
        if shapes_logits:
            # Logprobs describe the model (with its penalties); the bias and the grammar only steer the draw.
            if any(p.logprobs is not None for p in params):
                logits = logits.clone()
            shape_logits_(logits, rows, grammar_bitmask)

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            token_ids[greedy_rows] = _argmax(_take(logits, _index(greedy_rows, num_rows, device)))
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits, rows, random_rows)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not logprob_rows:
            return [SampledToken(t) for t in token_ids.tolist()]
        return self._with_logprobs(model_logits, token_ids, params, logprob_rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]) -> torch.Tensor:
        device = logits.device
        params = [rows[i].params for i in random_rows]
        x = _take(logits, _index(random_rows, logits.shape[0], device))
        probs = (x / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)).softmax(dim=-1)

        truncated = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if truncated:
            idx = _index(truncated, len(params), device)
            top_k = torch.tensor([params[j].top_k for j in truncated], dtype=torch.long, device=device)
            top_p = torch.tensor([params[j].top_p for j in truncated], dtype=torch.float32, device=device)
            kept = _take(probs, idx)
            kept = kept * truncation_mask(kept, top_k, top_p)
            probs = kept if idx is None else probs.index_copy(0, idx, kept)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            probs = probs * (probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True))

        return _inverse_cdf(probs, self._uniforms(rows, random_rows, device))

    @staticmethod
    def _uniforms(rows: list[SamplingRow], random_rows: list[int], device: torch.device) -> torch.Tensor:
        """One U[0,1) per row: from the global generator, or for a seeded row from a generator
        seeded by (seed, output length), so its draw ignores the rest of the batch."""
        uniform = torch.rand(len(random_rows), 1, device=device)
        for j, i in enumerate(random_rows):
            seed = rows[i].params.seed
            if seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(_row_seed(seed, len(rows[i].output_token_ids)))
                uniform[j] = torch.rand(1, generator=generator, device=device)
        return uniform

    def _with_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], logprob_rows: list[int]
    ) -> list[SampledToken]:
        idx = _index(logprob_rows, logits.shape[0], logits.device)
        # Logprobs of the penalised distribution before temperature/top-k/top-p/min-p: they describe
        # the model (with the penalties the user asked for), not this request's sampling knobs.
        logprobs = _take(logits, idx).log_softmax(dim=-1)
        chosen = logprobs.gather(1, _take(token_ids, idx).unsqueeze(1)).squeeze(1).tolist()
        max_top = max(params[i].logprobs for i in logprob_rows)
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()

        out = [SampledToken(t) for t in token_ids.tolist()]
        for j, i in enumerate(logprob_rows):
            k = params[i].logprobs
            out[i].logprob = chosen[j]
            out[i].top_logprobs = list(zip(top_ids[j][:k], top_values[j][:k]))
        return out
