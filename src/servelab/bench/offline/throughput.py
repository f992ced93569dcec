"""`servelab bench throughput`: offline batch throughput, like `vllm bench throughput`, with several
servelab schedules and the Hugging Face static-batching baseline measured in the same run."""
from __future__ import annotations

import argparse
import dataclasses
import random
import shlex
import sys
import time
from pathlib import Path

from servelab.bench.results import DEFAULT_DIR
from servelab.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput on random prompts (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=288)
    p.add_argument("--output-len", type=int, default=144)
    p.add_argument("--range-ratio", type=float, default=0.7778,
                   help="lengths uniform in [len*(1-r), len*(1+r)]; defaults give 64-512 in, 32-256 out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedules", default=None,
                   help="comma-separated schedules to run one after another on the same requests "
                        "(default: --schedule)")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run Hugging Face transformers generate with static batches")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--hf-dtype", default=None, help="dtype for the HF baseline (default: servelab's)")
    p.add_argument("--baseline-num-prompts", type=int, default=None,
                   help="run the baseline (and servelab again, for a like-for-like ratio) on only the first "
                        "N requests: HF's bf16 path is slow on CPUs without native bf16")
    p.add_argument("--name", default=None, help="result file stem under --result-dir")
    p.add_argument("--result-dir", type=Path, default=DEFAULT_DIR, help="folder for the result files")
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


def _rates(label: str, n: int, prompt_tokens: int, output_tokens: int, elapsed: float, **extra) -> dict:
    return {"engine": label, "num_requests": n, "elapsed_s": elapsed, "request_throughput": n / elapsed,
            "output_throughput": output_tokens / elapsed,
            "total_token_throughput": (prompt_tokens + output_tokens) / elapsed, **extra}


def run_servelab(engine, prompts: list[list[int]], outs: list[int], label: str) -> dict:
    from tqdm import tqdm

    from servelab.sampling_params import SamplingParams

    peak_kv, steps = 0.0, 0
    preempted_before = engine.get_state().num_preemptions_total
    bar = tqdm(total=len(prompts), desc=label, unit="req")
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, outs)):
        engine.add_request(engine.input_processor.process_inputs(
            f"{label}-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=n, ignore_eos=True)))
    while engine.has_unfinished_requests():
        bar.update(sum(o.finished for o in engine.step()))
        steps += 1
        if engine.last_step_stats is not None:
            peak_kv = max(peak_kv, engine.last_step_stats.kv_usage)
    elapsed = time.perf_counter() - start
    bar.close()
    return _rates(label, len(prompts), sum(map(len, prompts)), sum(outs), elapsed, peak_kv_usage=peak_kv,
                  num_preemptions=engine.get_state().num_preemptions_total - preempted_before, num_steps=steps)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from servelab.bench.results import markdown_table, write_results
    from servelab.engine.llm_engine import LLMEngine

    base_args = EngineArgs.from_cli_args(args)
    schedules = (args.schedules or base_args.schedule).split(",")
    runs, engine = [], None
    for schedule in schedules:
        engine_args = dataclasses.replace(base_args, schedule=schedule)
        engine = LLMEngine.from_engine_args(engine_args)
        tok = engine.tokenizer
        # Ordinary tokens only: the special ones sit at the start of the vocabulary.
        vocab = range(max(tok.all_special_ids, default=0) + 1, engine.config.model.vocab_size)
        prompts, outs = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                        vocab, args.seed)
        runs.append(run_servelab(engine, prompts, outs, f"servelab --schedule {schedule}"))
    dtype = engine.config.dtype
    result = {"dtype": dtype, "num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "output_tokens": sum(outs), "max_num_seqs": base_args.max_num_seqs,
              "max_num_batched_tokens": base_args.max_num_batched_tokens, "runs": runs}
    if "static" in schedules and "continuous" in schedules:
        by = {r["engine"].rsplit(" ", 1)[-1]: r for r in runs}
        result["continuous_vs_static"] = by["continuous"]["output_throughput"] / by["static"]["output_throughput"]
    if args.baseline == "hf":
        from servelab.bench.offline.hf_baseline import run_hf_static
        from servelab.model.loader import resolve_model_path

        n = args.baseline_num_prompts or len(prompts)
        sub_prompts, sub_outs = prompts[:n], outs[:n]
        ours = runs[-1] if n == len(prompts) else run_servelab(
            engine, sub_prompts, sub_outs, f"servelab --schedule {schedules[-1]} (first {n})")
        if n != len(prompts):
            runs.append(ours)
        del engine
        hf_dtype = args.hf_dtype or dtype
        bar = tqdm(total=n, desc=f"hf static batch {args.hf_batch_size}", unit="req")
        hf = run_hf_static(resolve_model_path(args.model), getattr(__import__("torch"), hf_dtype), sub_prompts,
                           sub_outs, args.hf_batch_size, tok.eos_token_ids[0], bar)
        bar.close()
        hf_run = _rates(f"hf transformers {hf_dtype} static batch {args.hf_batch_size}", n, hf["prompt_tokens"],
                        hf["output_tokens"], hf["elapsed_s"])
        runs.append(hf_run)
        result["speedup_vs_hf"] = ours["output_throughput"] / hf_run["output_throughput"]
    result["command"] = "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    name = args.name or f"throughput-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = [{"engine": r["engine"], "requests": r["num_requests"], "requests/s": r["request_throughput"],
             "output tok/s": r["output_throughput"], "total tok/s": r["total_token_throughput"],
             "elapsed s": r["elapsed_s"], "peak KV use": f"{r['peak_kv_usage']:.1%}" if "peak_kv_usage" in r else "-",
             "preemptions": r.get("num_preemptions", "-")} for r in runs]
    json_path, _ = write_results(name, result, rows, out_dir=args.result_dir)
    print(markdown_table(rows))
    for key, label in (("continuous_vs_static", "continuous / static"), ("speedup_vs_hf", "servelab / HF")):
        if key in result:
            print(f"{label} output tokens/s: {result[key]:.2f}x")
    print(f"results: {json_path}")
    return 0
