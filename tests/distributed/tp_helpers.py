"""Helpers shared by the tensor-parallel tests."""
from __future__ import annotations

import torch


def greedy_token_ids(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from servelab import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outputs]


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 30000, (n,), generator=g).tolist() for n in lengths]
