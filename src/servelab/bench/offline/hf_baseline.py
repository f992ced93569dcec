"""The Hugging Face transformers baseline: static batches through model.generate, left-padded."""
from __future__ import annotations

import time
from pathlib import Path

import torch


def run_hf_static(folder: Path, dtype: torch.dtype, prompts: list[list[int]], output_lens: list[int],
                  batch_size: int, pad_token_id: int, progress=None) -> dict:
    """Each batch generates until its longest requested output (EOS masked, like ignore_eos); only
    the requested tokens count as output. Returns elapsed seconds and token counts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch, outs = prompts[b:b + batch_size], output_lens[b:b + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        new = max(outs)
        with torch.inference_mode():
            model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad_token_id)
        if progress is not None:
            progress.update(len(batch))
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "num_requests": len(prompts),
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens)}
