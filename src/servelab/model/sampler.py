"""Turns a batch of next-token logits into sampled tokens, each row with its own SamplingParams."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

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


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    # (num_rows, vocab_size) float32 count of each token id per row
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    flat = list(itertools.chain.from_iterable(token_lists))
    if flat:
        lengths = torch.tensor([len(t) for t in token_lists], device=device)
        row_ids = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
        token_ids = torch.tensor(flat, dtype=torch.long, device=device)
        counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM's penalties on float32 logits (num_rows, vocab): repetition over prompt and output,
    then frequency and presence over the output only. Returns a new tensor."""
    device, vocab_size = logits.device, logits.shape[1]
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab_size, device)
    prompt_counts = _token_counts([r.prompt_token_ids for r in rows], vocab_size, device)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

    repetition = column([r.params.repetition_penalty for r in rows]).expand_as(logits)
    repetition = torch.where((output_counts > 0) | (prompt_counts > 0), repetition, 1.0)
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits -= column([r.params.frequency_penalty for r in rows]) * output_counts
    logits -= column([r.params.presence_penalty for r in rows]) * (output_counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """One ascending sort for all rows, as vLLM does. top_k (num_rows,) long with 0 = off, top_p
    (num_rows,) float. Ties with the k-th logit are kept; the most likely token always survives."""
    vocab_size = logits.shape[1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k > 0, top_k, vocab_size).clamp_(max=vocab_size)
    kth_logit = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth_logit, -float("inf"))
    # Drop the low tail whose total mass is <= 1 - p: the kept set is the smallest reaching p.
    cumulative = logits_sort.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, -float("inf"))
    return torch.empty_like(logits).scatter_(1, logits_idx, logits_sort)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """logits (num_rows, vocab) in the model dtype; one SampledToken per row, in order."""
        params = [r.params for r in rows]
        if all(p.temperature < 1e-5 and p.logprobs is None and not p.needs_penalties for p in params):
            return [SampledToken(t) for t in logits.argmax(dim=-1).tolist()]

        num_rows, device = logits.shape[0], logits.device
        penalty_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        logits = logits.to(torch.float32, copy=bool(penalty_rows))
        if penalty_rows:
            idx = torch.tensor(penalty_rows, dtype=torch.long, device=device)
            logits[idx] = apply_penalties(logits[idx], [rows[i] for i in penalty_rows])

        token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            idx = _index(greedy_rows, num_rows, device)
            token_ids[greedy_rows] = _take(logits, idx).argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample(logits, rows, random_rows)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not logprob_rows:
            return [SampledToken(t) for t in token_ids.tolist()]
        return self._with_logprobs(logits, token_ids, params, logprob_rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], random_rows: list[int]) -> torch.Tensor:
        device = logits.device
        params = [rows[i].params for i in random_rows]
        x = _take(logits, _index(random_rows, logits.shape[0], device))
        x = x / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)

        truncated = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if truncated:
            sub = [params[j] for j in truncated]
            idx = _index(truncated, len(params), device)
            top_k = torch.tensor([p.top_k for p in sub], dtype=torch.long, device=device)
            top_p = torch.tensor([p.top_p for p in sub], dtype=torch.float32, device=device)
            filtered = apply_top_k_top_p(_take(x, idx), top_k, top_p)
            x = filtered if idx is None else x.index_copy(0, idx, filtered)

        probs = x.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < threshold, 0.0)

        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine), and
        # lets each seeded row take its noise from its own generator.
        noise = torch.empty_like(probs).exponential_()
        for j, p in enumerate(params):
            if p.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(_row_seed(p.seed, len(rows[random_rows[j]].output_token_ids)))
                noise[j].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)

    def _with_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams], logprob_rows: list[int]
    ) -> list[SampledToken]:
        device = logits.device
        idx = _index(logprob_rows, logits.shape[0], device)
        # Logprobs of the penalised distribution before temperature/top-k/top-p/min-p: they describe
        # the model (as the user configured its penalties), not the sampling knobs of this request.
        logprobs = _take(logits, idx).log_softmax(dim=-1)
        chosen = logprobs.gather(1, _take(token_ids, idx).unsqueeze(1)).squeeze(1).tolist()
        max_top = max(params[i].logprobs for i in logprob_rows)
        top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (logprobs[:, :0], logprobs[:, :0])
        top_values, top_ids = top_values.tolist(), top_ids.long().tolist()

        out = [SampledToken(t) for t in token_ids.tolist()]
        for j, i in enumerate(logprob_rows):
            k = params[i].logprobs
            out[i].logprob = chosen[j]
            out[i].top_logprobs = list(zip(top_ids[j][:k], top_values[j][:k]))
        return out
