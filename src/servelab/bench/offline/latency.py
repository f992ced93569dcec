"""`servelab bench latency`: time to first token and decode speed for a fixed batch, like
`vllm bench latency`."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from servelab.bench.results import DEFAULT_DIR
from servelab.engine_args import EngineArgs


def add_parser(sub) -> None:
    p = sub.add_parser("latency", help="prefill latency and decode tokens/s for one batch")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--name", default=None)
    p.add_argument("--result-dir", type=Path, default=DEFAULT_DIR, help="folder for the result files")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from servelab.bench.results import markdown_table, write_results
    from servelab.engine.llm_engine import LLMEngine
    from servelab.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    prompt_ids = [100 + i % 1000 for i in range(args.input_len)]
    runs = []
    for it in range(args.num_iters + 1):  # the first run warms up
        for b in range(args.batch_size):
            # a first token of its own: no prompt finds another's blocks in the prefix cache
            prompt = {"prompt_token_ids": [2000 + it * args.batch_size + b, *prompt_ids[1:]]}
            engine.add_request(engine.input_processor.process_inputs(f"lat{it}-{b}", prompt, params))
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter()
        end = time.perf_counter()
        if it:
            runs.append((first - start, end - first))
    ttft = sorted(r[0] for r in runs)[len(runs) // 2]
    decode = sorted(r[1] for r in runs)[len(runs) // 2]
    decode_tps = args.batch_size * (args.output_len - 1) / decode
    row = {"batch": args.batch_size, "input len": args.input_len, "output len": args.output_len,
           "dtype": engine.config.dtype, "prefill+first token ms": ttft * 1000,
           "decode tok/s": decode_tps, "ms per decode step": decode / (args.output_len - 1) * 1000}
    name = args.name or f"latency-b{args.batch_size}-{time.strftime('%Y%m%d-%H%M%S')}"
    payload = {"median_ttft_s": ttft, "median_decode_s": decode, "decode_tokens_per_s": decode_tps,
               "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
               "dtype": engine.config.dtype,
               "command": "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    json_path, _ = write_results(name, payload, [row], out_dir=args.result_dir)
    print(markdown_table([row]))
    print(f"results: {json_path}")
    return 0
