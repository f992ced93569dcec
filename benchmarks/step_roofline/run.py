"""Batched engine steps against this machine's roofline, measured in the same run (issue 13's "batched steps at
>= 60% of the roofline for the precision used").

The roofline is the one `servelab bench peers` measures: int8 GEMM (fbgemm dynamic quantization through torch)
on the model's linear shapes, one forward's mix, at M = 32, 64, 128 and 512 rows, measured before and after the
engine's rounds and averaged; the best M is the bar.
The engine then runs a burst of 64 requests (128 random prompt tokens, 64 output tokens, ignore_eos; fresh
prompts each round, so no prefix-cache hits) through `LLMEngine.step`, timing every step from its StepStats.
A step's work is counted as its linear layers only (2 * k * n per token and layer; the LM head for the decode
rows, which sample; attention and the prefill chunks' sampled rows are left out, so the share is a lower bound).

Usage: python benchmarks/step_roofline/run.py [--quantization int8] [--kv-cache-dtype auto|int8] [--rounds 3]
       [--out benchmarks/step_roofline/step_roofline.json]
Round 0 warms up and is not reported. For an A/B, run it with PYTHONPATH=OTHER_CHECKOUT/src beside this tree.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from servelab.bench.peers.roofline import int8_gemm_seconds, linear_shapes
from servelab.llm import LLM
from servelab.model.loader import resolve_model_path
from servelab.sampling_params import SamplingParams


def roofline_int8(shapes: dict, ms=(32, 64, 128, 512), min_time_s: float = 0.5) -> dict[int, float]:
    """GFLOP/s of one forward's mix of int8 linears at each M."""
    out = {}
    for m in ms:
        flops = sum(count * 2.0 * m * k * n for k, n, count in shapes.values())
        seconds = sum(count * int8_gemm_seconds(m, k, n, min_time_s) for k, n, count in shapes.values())
        out[m] = flops / seconds / 1e9
    return out


def step_flops(shapes: dict, scheduled_tokens: int, decode_rows: int) -> float:
    body = sum(count * 2.0 * k * n for name, (k, n, count) in shapes.items() if name != "lm_head")
    k, n, _ = shapes["lm_head"]
    return scheduled_tokens * body + decode_rows * 2.0 * k * n


def burst_steps(llm: LLM, seed: int, batch: int = 64, prompt_len: int = 128, max_tokens: int = 64) -> list:
    engine = llm.engine
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    for _ in range(batch):
        prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(prompt_len)]}
        engine.add_request(engine.input_processor.process_inputs(engine.new_request_id(), prompt, params))
    steps = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.last_step_stats is not None:
            steps.append(engine.last_step_stats)
    return steps


def summarize(durations: list[float], flops: float, best_gflops: float) -> dict:
    median = statistics.median(durations)
    return {"steps": len(durations), "median_ms": median * 1e3, "min_ms": min(durations) * 1e3,
            "max_ms": max(durations) * 1e3, "gflop": flops / 1e9, "gflops": flops / median / 1e9,
            "roofline_share": flops / median / 1e9 / best_gflops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or int8 (servelab's --kv-cache-dtype)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("step_roofline.json")))
    args = parser.parse_args()

    llm = LLM(quantization=args.quantization, max_num_seqs=args.batch, max_num_batched_tokens=1024,
              kv_cache_dtype=args.kv_cache_dtype)
    shapes = linear_shapes(json.loads((resolve_model_path(None) / "config.json").read_text()))
    before = roofline_int8(shapes)
    print("int8 GEMM roofline GFLOP/s by M, before:", {m: round(g, 1) for m, g in before.items()}, flush=True)

    prefill, decode, burst_flops, burst_s = [], [], 0.0, 0.0
    for r in range(args.rounds):
        steps = burst_steps(llm, seed=r, batch=args.batch)
        if r == 0:
            continue  # warm-up
        burst_flops += sum(step_flops(shapes, s.num_scheduled_tokens, s.num_decode_requests) for s in steps)
        burst_s += sum(s.duration for s in steps)
        for s in steps:
            if s.num_prefill_tokens == 1024 and s.num_decode_requests == 0:
                prefill.append(s.duration)
            elif s.num_prefill_tokens == 0 and s.num_decode_requests == args.batch:
                decode.append(s.duration)
    # This CPU's speed drifts by tens of percent within minutes: the roofline is measured before and after
    # the engine's rounds and averaged, so that both sides of the ratio see the same machine.
    after = roofline_int8(shapes)
    print("int8 GEMM roofline GFLOP/s by M, after:", {m: round(g, 1) for m, g in after.items()}, flush=True)
    roofline = {m: (before[m] + after[m]) / 2 for m in before}
    best = max(roofline.values())
    result = {
        "command": "python benchmarks/step_roofline/run.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(), "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "roofline_int8_gflops": roofline, "roofline_before": before, "roofline_after": after,
        "roofline_best_gflops": best,
        "prefill_step_1024_tokens": summarize(prefill, step_flops(shapes, 1024, 0), best),
        "decode_step_batch": summarize(decode, step_flops(shapes, args.batch, args.batch), best),
        "decode_step_share_of_same_m": None,
        "whole_burst": {"gflop": burst_flops / 1e9, "engine_s": burst_s, "gflops": burst_flops / burst_s / 1e9,
                        "roofline_share": burst_flops / burst_s / 1e9 / best},
    }
    if args.batch in roofline:  # a batch-B decode step's GEMMs run at M = B
        result["decode_step_share_of_same_m"] = result["decode_step_batch"]["gflops"] / roofline[args.batch]
    for name in ("prefill_step_1024_tokens", "decode_step_batch"):
        s = result[name]
        print(f"{name}: {s['steps']} steps, median {s['median_ms']:.1f} ms ({s['min_ms']:.1f}-{s['max_ms']:.1f}), "
              f"{s['gflop']:.1f} GFLOP -> {s['gflops']:.0f} GFLOP/s = {s['roofline_share']:.0%} of {best:.0f}")
    if result["decode_step_share_of_same_m"] is not None:
        print(f"decode step: {result['decode_step_share_of_same_m']:.0%} of the int8 roofline at M = {args.batch}")
    w = result["whole_burst"]
    print(f"whole burst (engine steps, all rounds after the first): {w['gflop']:.0f} GFLOP in {w['engine_s']:.1f} s "
          f"-> {w['gflops']:.0f} GFLOP/s = {w['roofline_share']:.0%} of {best:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
