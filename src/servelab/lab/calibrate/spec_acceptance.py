"""How often this machine's engine accepts prompt-lookup drafts, as the lab's one knob: run code-edit prompts
(bench/grounded_prompts.py) greedily through an engine with the speculative config, read vLLM's spec_decode
counters, and fit the per-draft acceptance rate a of the lab's model (each draft accepted with probability a
until the first rejection, a draft at every decode step) so that its tokens per decode step,
(1 - a^(K+1)) / (1 - a), equal the measured ones. Decode steps without a draft (no n-gram matched) count as
steps of one token, so the fitted rate is below vLLM's acceptance rate (accepted / draft tokens) when drafts
are sometimes missing."""
from __future__ import annotations

import time

from servelab.config import SpeculativeConfig


def tokens_per_step(rate: float, k: int) -> float:
    """Expected tokens a decode step gives with k drafts, each accepted with probability rate until one is not."""
    return k + 1.0 if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


def fit_acceptance_rate(tokens_per_decode_step: float, k: int) -> float:
    """The rate whose tokens_per_step(rate, k) is tokens_per_decode_step (bisection; clamped to [0, 1])."""
    if tokens_per_decode_step <= 1:
        return 0.0
    if tokens_per_decode_step >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if tokens_per_step(mid, k) < tokens_per_decode_step:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def measure_acceptance(engine, config: SpeculativeConfig, prompts: list[str] | None = None,
                       max_tokens: int = 128) -> dict:
    """engine: an LLMEngine built with config. Runs the prompts (default: 8 code-edit prompts) to completion
    and returns the counts and the fitted rate (the spec_decode entry of the CPU profile)."""
    from servelab.bench.grounded_prompts import code_edit_prompts
    from servelab.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = engine.get_state()
    outputs = {}
    prompts = code_edit_prompts(8) if prompts is None else prompts
    for index, prompt in enumerate(prompts):
        engine.add_request(engine.input_processor.process_inputs(f"spec-{index}", prompt, params,
                                                                 arrival_time=time.perf_counter()))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = len(out.outputs[0].token_ids)
    after = engine.get_state()
    drafts = after.spec_num_drafts_total - before.spec_num_drafts_total
    draft_tokens = after.spec_num_draft_tokens_total - before.spec_num_draft_tokens_total
    accepted = after.spec_num_accepted_tokens_total - before.spec_num_accepted_tokens_total
    decode_tokens = sum(n - 1 for n in outputs.values())  # each request's first token comes from its prefill
    # decode steps: those that verified a draft gave 1 + its accepted tokens, the others one token
    decode_steps = drafts + (decode_tokens - drafts - accepted)
    per_step = decode_tokens / decode_steps if decode_steps else 1.0
    k = config.num_speculative_tokens
    return {"speculative_config": {"method": config.method, "num_speculative_tokens": k,
                                   "prompt_lookup_max": config.prompt_lookup_max,
                                   "prompt_lookup_min": config.prompt_lookup_min},
            "workload": f"{len(prompts)} code-edit prompts, greedy, max_tokens {max_tokens}",
            "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "num_decode_steps": decode_steps, "num_decode_tokens": decode_tokens,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "tokens_per_decode_step": per_step,
            "fitted_acceptance_rate": fit_acceptance_rate(per_step, k)}
