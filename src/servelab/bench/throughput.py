"""`servelab bench throughput`: offline batch throughput, like `vllm bench throughput`, with the
Hugging Face static-batching baseline in the same run."""
from __future__ import annotations

import argparse
import random
import shlex
import sys
import time

from servelab.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput on random prompts (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=288)
    p.add_argument("--output-len", type=int, default=144)
    p.add_argument("--range-ratio", type=float, default=0.7778,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; defaults give 64-512 in, 32-256 out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run Hugging Face transformers generate with static batches")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--name", default=None, help="result file stem under benchmarks/results/")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def random_requests(num: int, input_len: int, output_len: int, ratio: float, vocab: range, seed: int):
    rng = random.Random(seed)
    span = lambda n: (max(1, round(n * (1 - ratio))), max(1, round(n * (1 + ratio))))  # noqa: E731
    (in_lo, in_hi), (out_lo, out_hi) = span(input_len), span(output_len)
    prompts, outs = [], []
    for _ in range(num):
        prompts.append([rng.choice(vocab) for _ in range(rng.randint(in_lo, in_hi))])
        outs.append(rng.randint(out_lo, out_hi))
    return prompts, outs


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from servelab.bench.results import markdown_table, write_results
    from servelab.llm_engine import LLMEngine
    from servelab.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    tok = engine.tokenizer
    # Ordinary tokens only: skip the special ones at the start of the vocabulary.
    vocab = range(len(tok.all_special_ids) + 1, engine.config.model.vocab_size)
    prompts, outs = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                    vocab, args.seed)
    peak_kv, steps = 0.0, 0
    bar = tqdm(total=len(prompts), desc=f"servelab {engine_args.schedule}", unit="req")
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, outs)):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        done = sum(o.finished for o in engine.step())
        bar.update(done)
        steps += 1
        if engine.last_step_stats is not None:
            peak_kv = max(peak_kv, engine.last_step_stats.kv_usage)
    elapsed = time.perf_counter() - start
    bar.close()
    prompt_tokens, output_tokens = sum(map(len, prompts)), sum(outs)
    rows = [{
        "engine": f"servelab --schedule {engine_args.schedule}", "requests/s": len(prompts) / elapsed,
        "output tok/s": output_tokens / elapsed, "total tok/s": (prompt_tokens + output_tokens) / elapsed,
        "elapsed s": elapsed, "peak KV use": f"{peak_kv:.1%}",
        "preemptions": engine.scheduler.num_preemptions_total,
    }]
    result = {"servelab": {"schedule": engine_args.schedule, "dtype": engine.config.dtype, "elapsed_s": elapsed,
                           "request_throughput": len(prompts) / elapsed, "output_throughput": output_tokens / elapsed,
                           "total_token_throughput": (prompt_tokens + output_tokens) / elapsed,
                           "peak_kv_usage": peak_kv, "num_preemptions": engine.scheduler.num_preemptions_total,
                           "num_steps": steps, "max_num_seqs": engine_args.max_num_seqs,
                           "max_num_batched_tokens": engine_args.max_num_batched_tokens,
                           "num_kv_blocks": engine.executor.num_blocks},
              "num_prompts": len(prompts), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}
    if args.baseline == "hf":
        from servelab.bench.hf_baseline import run_hf_static
        from servelab.model.loader import resolve_model_path

        del engine
        bar = tqdm(total=len(prompts), desc=f"hf static batch {args.hf_batch_size}", unit="req")
        dtype = getattr(__import__("torch"), result["servelab"]["dtype"])
        hf = run_hf_static(resolve_model_path(args.model), dtype, prompts, outs, args.hf_batch_size,
                           tok.eos_token_ids[0], bar)
        bar.close()
        t = hf["elapsed_s"]
        result["hf"] = {"batch_size": args.hf_batch_size, "elapsed_s": t, "request_throughput": len(prompts) / t,
                        "output_throughput": output_tokens / t,
                        "total_token_throughput": (prompt_tokens + output_tokens) / t}
        result["speedup_vs_hf"] = result["servelab"]["output_throughput"] / result["hf"]["output_throughput"]
        rows.append({"engine": f"hf transformers static batch {args.hf_batch_size}", "requests/s": len(prompts) / t,
                     "output tok/s": output_tokens / t, "total tok/s": (prompt_tokens + output_tokens) / t,
                     "elapsed s": t, "peak KV use": "-", "preemptions": "-"})
    result["command"] = "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    name = args.name or f"throughput-{engine_args.schedule}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, _ = write_results(name, result, rows)
    print(markdown_table(rows))
    if "speedup_vs_hf" in result:
        print(f"\nservelab / HF output tokens/s: {result['speedup_vs_hf']:.2f}x")
    print(f"results: {json_path}")
    return 0
