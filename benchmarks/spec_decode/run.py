"""Prompt-lookup speculative decoding on this machine's engine: single-stream and burst decode speed with and
without --speculative-config, on code-edit prompts (the answer copies the prompt: drafts hit), open-ended story
prompts, and prompts of random tokens (little to copy: drafts mostly miss), in one process, interleaved,
--repeats times; median and range.

    flock /tmp/servelab-heavy.lock nice -n 10 python benchmarks/spec_decode/run.py --out benchmarks/spec_decode/result.json

Single stream: the prompts one at a time; burst: all of them in one LLM.generate call. Speed is output tokens
over wall seconds (prefill included, the same prompts both ways). Greedy, max_tokens fixed, EOS honoured.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from servelab import LLM, SamplingParams
from servelab.bench.grounded_prompts import code_edit_prompts, open_ended_prompts
from servelab.lab.calibrate.spec_acceptance import fit_acceptance_rate


def counters(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.get_state()
    return s.spec_num_drafts_total, s.spec_num_draft_tokens_total, s.spec_num_accepted_tokens_total


def timed(llm: LLM, prompts: list, params: SamplingParams, burst: bool) -> tuple[float, int, list[list[int]]]:
    start = time.perf_counter()
    if burst:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return seconds, sum(map(len, tokens)), tokens


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="bfloat16", help="an explicit dtype runs float weights (no --quantization auto)")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                     '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    ap.add_argument("--compare-fixed", action="store_true",
                    help='also run the same config with "draft_min_acceptance": 0 (every match drafted in full, as vLLM)')
    ap.add_argument("--out", default=None, help="write the result here as JSON")
    args = ap.parse_args()
    common = dict(dtype=args.dtype, kv_cache_memory=1.0, max_num_seqs=args.num_prompts)
    engines = {"plain": LLM(args.model, **common),
               "spec": LLM(args.model, speculative_config=json.loads(args.speculative_config), **common)}
    if args.compare_fixed:
        engines["fixed"] = LLM(args.model, speculative_config={**json.loads(args.speculative_config),
                                                               "draft_min_acceptance": 0}, **common)
    names = list(engines)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rng = random.Random(0)
    random_tokens = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(256)]}
                     for _ in range(args.num_prompts)]
    workloads = {"code-edit": code_edit_prompts(args.num_prompts), "open-ended": open_ended_prompts(args.num_prompts),
                 "random-tokens": random_tokens}
    for llm in engines.values():  # warm up: the kernels' first calls
        llm.generate(workloads["open-ended"][:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    speeds: dict = {}
    acceptance: dict = {}
    identical: dict = {}
    for repeat in range(args.repeats):
        for workload, prompts in workloads.items():
            for mode in ("single", "burst"):
                order = names[repeat % len(names):] + names[:repeat % len(names)]  # rotates by repeat
                outputs = {}
                for name in order:
                    llm = engines[name]
                    before = counters(llm)
                    seconds, num_tokens, outputs[name] = timed(llm, prompts, params, mode == "burst")
                    after = counters(llm)
                    speeds.setdefault(workload, {}).setdefault(mode, {}).setdefault(name, []).append(num_tokens / seconds)
                    if name == "spec":
                        drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
                        acc = acceptance.setdefault(workload, {"num_drafts": 0, "num_draft_tokens": 0,
                                                               "num_accepted_tokens": 0, "num_output_tokens": 0,
                                                               "num_decode_tokens": 0})
                        acc["num_decode_tokens"] += sum(len(t) - 1 for t in outputs[name])
                        acc["num_drafts"] += drafts
                        acc["num_draft_tokens"] += draft_tokens
                        acc["num_accepted_tokens"] += accepted
                        acc["num_output_tokens"] += num_tokens
                    print(f"repeat {repeat} {workload:10s} {mode:6s} {name:5s} {num_tokens / seconds:7.1f} tok/s",
                          flush=True)
                same = sum(all(o[i] == outputs["plain"][i] for o in outputs.values()) for i in range(len(prompts)))
                identical.setdefault(workload, []).append(f"{same}/{len(prompts)}")
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v!r}")
             for k, v in vars(args).items() if k != "out" and v is not None and v is not False]
    result = {"command": "python benchmarks/spec_decode/run.py " + " ".join(flags),
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "speculative_config": json.loads(args.speculative_config),
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "workloads": {}}
    for workload in workloads:
        acc = acceptance[workload]
        entry = {"identical_outputs": identical[workload],
                 "acceptance_rate": acc["num_accepted_tokens"] / max(acc["num_draft_tokens"], 1),
                 "mean_acceptance_length": 1 + acc["num_accepted_tokens"] / max(acc["num_drafts"], 1),
                 **acc}
        # the lab's --spec-acceptance-rate that gives these tokens per decode step (lab/calibrate/spec_acceptance.py)
        per_step = acc["num_decode_tokens"] / max(acc["num_decode_tokens"] - acc["num_accepted_tokens"], 1)
        entry["tokens_per_decode_step"] = per_step
        entry["fitted_acceptance_rate"] = fit_acceptance_rate(per_step, result["speculative_config"]["num_speculative_tokens"])
        for mode, by_engine in speeds[workload].items():
            plain, spec = summary(by_engine["plain"]), summary(by_engine["spec"])
            entry[mode] = {"plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec["median"] / plain["median"]}
            if "fixed" in by_engine:
                fixed = summary(by_engine["fixed"])
                entry[mode].update(fixed_tok_s=fixed, fixed_speedup=fixed["median"] / plain["median"])
        result["workloads"][workload] = entry
        fixed_note = "".join(f", {mode} x{entry[mode]['fixed_speedup']:.2f}" for mode in ("single", "burst")
                        if "fixed_speedup" in entry[mode])
        print(f"{workload}: acceptance {entry['acceptance_rate']:.2f}, mean acceptance length "
              f"{entry['mean_acceptance_length']:.2f}, single-stream x{entry['single']['speedup']:.2f}, "
              f"burst x{entry['burst']['speedup']:.2f}{' (fixed length' + fixed_note + ')' if fixed_note else ''}, "
              f"identical {identical[workload]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
