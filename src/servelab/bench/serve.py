"""`servelab bench serve`: load-test any OpenAI-compatible server the way `vllm bench serve` does.

The workload (arrivals and lengths) is the lab's (lab/workload.py), so one seed gives the same
requests here and in `servelab lab simulate`. Metrics come from metrics/request_stats.py, the one
definition shared with the server and the simulator. The result JSON carries vLLM's summary keys
(`completed`, `failed`, `request_throughput`, `mean_ttft_ms`, ..., `request_goodput`) plus per-request
lists; a markdown table and PNG plots go to bench-results/<name>/ (--result-dir).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

from servelab.bench.datasets import BENCH_DATASETS, BenchRequest, build_requests, load_tokenizer
from servelab.bench.results import DEFAULT_DIR
from servelab.bench.loadgen import ENDPOINTS, ClientConfig, RequestResult, first_model_id, probe
from servelab.trace_formats import add_trace_args, trace_fields
from servelab.workload import WorkloadConfig
from servelab.metrics.request_stats import RequestTiming, compute_metrics, meets_slos

SLO_KEYS = ("ttft", "tpot", "e2el")
RESULTS_DIR = DEFAULT_DIR


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds, vLLM's --goodput)."""
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput takes KEY:MS pairs like ttft:500, got {item!r}") from None
        if key not in SLO_KEYS or slos[key] <= 0:
            raise ValueError(f"--goodput keys are {', '.join(SLO_KEYS)} with a positive ms value, got {item!r}")
    return slos


def add_workload_args(p: argparse.ArgumentParser, num_prompts: int = 1000, with_rate: bool = True) -> None:
    p.add_argument("--dataset", choices=BENCH_DATASETS, default="random")
    p.add_argument("--dataset-path", type=Path, default=None, help="JSONL prompts for --dataset jsonl")
    p.add_argument("--input-len", type=int, default=None,
                   help="random dataset, default 1024; prefix-shared: each request's own suffix, default 256")
    p.add_argument("--prefix-len", type=int, default=None, help="prefix-shared dataset: shared prefix, default 256")
    p.add_argument("--num-prefixes", type=int, default=None, help="prefix-shared dataset: distinct prefixes, default 10")
    p.add_argument("--output-len", type=int, default=None, help="default 128 (random, jsonl)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in [len*(1-r), len*(1+r)]")
    if with_rate:
        p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--seed", type=int, default=0)
    add_trace_args(p)


def add_request_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--prompt-format", choices=("auto", "ids", "text"), default="auto",
                   help="auto: token ids for /v1/completions with random prompts, else text")
    p.add_argument("--tokenizer", default=None, help="model folder or .gguf whose tokenizer builds prompts and "
                   "counts output tokens when the server sends no usage (default: the default model's)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens (vLLM's extra)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="results go to <result-dir>/<name>/")
    p.add_argument("--result-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--result-file", type=Path, default=None, help="also write the result JSON here")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, goodput)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name for the API (default: the first on /v1/models)")
    add_workload_args(p)
    add_request_args(p)
    add_output_args(p)
    p.set_defaults(func=run)


def workload_from_args(args: argparse.Namespace, request_rate: float | None = None) -> WorkloadConfig:
    return WorkloadConfig(dataset="random" if args.dataset == "jsonl" else args.dataset,
                          num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                          range_ratio=args.range_ratio, burstiness=args.burstiness, seed=args.seed,
                          request_rate=request_rate or getattr(args, "request_rate", math.inf),
                          prefix_len=getattr(args, "prefix_len", None), num_prefixes=getattr(args, "num_prefixes", None),
                          **trace_fields(args))


def prompt_format(args: argparse.Namespace) -> str:
    if args.prompt_format != "auto":
        return args.prompt_format
    return "ids" if args.endpoint == "/v1/completions" and args.dataset != "jsonl" else "text"


def requests_from_args(args: argparse.Namespace, tokenizer, request_rate: float | None = None) -> list[BenchRequest]:
    return build_requests(workload_from_args(args, request_rate), tokenizer, prompt_format(args), args.dataset,
                          args.dataset_path)


def summarize(results: list[RequestResult], start: float, end: float, peak_concurrency: int,
              slos_ms: dict[str, float] | None = None) -> dict:
    """vLLM's summary keys (through compute_metrics) plus the per-request lists, failed requests included."""
    from servelab.bench.report import tokens_per_second

    done = [r for r in results if r.success]
    timings = [RequestTiming(r.prompt_len, r.output_len, arrival=r.start, first_token=r.chunk_times[0],
                             finished=r.chunk_times[-1], token_times=r.chunk_times) for r in done]
    summary = compute_metrics(timings, end - start, slos_ms, num_failed=len(results) - len(done))
    if slos_ms:
        num_good = sum(meets_slos(t, slos_ms) for t in timings)
        summary["goodput"] = summary["request_goodput"]
        summary["goodput_share"] = num_good / len(results)  # failed requests miss every SLO
    per_request = {
        "start_times": [r.start - start for r in results],
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "e2els": [r.latency if r.success else 0.0 for r in results],
        "itls": [r.itls if r.success else [] for r in results],
        "errors": [r.error for r in results],
    }
    _, rates = tokens_per_second(per_request)
    summary["max_output_tokens_per_s"] = float(rates.max()) if rates.size else 0.0
    summary["max_concurrent_requests"] = peak_concurrency
    summary["error_counts"] = dict(Counter(r.error for r in results if r.error).most_common())
    return {**summary, **per_request}


def run_benchmark(client: ClientConfig, requests: list[BenchRequest], tokenizer, max_concurrency: int | None = None,
                  slos_ms: dict[str, float] | None = None, show_progress: bool = True, desc: str = "requests") -> dict:
    from tqdm import tqdm

    from servelab.bench.loadgen import run_requests

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    test = dataclasses.replace(requests[0], output_len=min(requests[0].output_len, 4), arrival_time=0.0)
    asyncio.run(probe(client, test))
    with tqdm(total=len(requests), desc=desc, unit="req", disable=not show_progress) as bar:
        results, start, end, peak = asyncio.run(run_requests(client, requests, max_concurrency, count_tokens, bar))
    return summarize(results, start, end, peak, slos_ms)


def client_from_args(args: argparse.Namespace, base_url: str, api_key: str | None = None,
                     model: str | None = None) -> ClientConfig:
    model = model or asyncio.run(first_model_id(base_url, api_key))
    return ClientConfig(base_url=base_url, endpoint=args.endpoint, model=model, api_key=api_key,
                        ignore_eos=args.ignore_eos)


def run_info(args: argparse.Namespace, client: ClientConfig, tokenizer) -> dict:
    rate = args.request_rate
    return {"backend": "openai-chat" if client.endpoint.endswith("chat/completions") else "openai",
            "base_url": client.base_url, "endpoint": client.endpoint, "model_id": client.model,
            "tokenizer_id": tokenizer.name, "num_prompts": args.num_prompts, "dataset": args.dataset,
            "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "seed": args.seed, "ignore_eos": client.ignore_eos,
            "command": "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])}


def save_result(result: dict, name: str, result_dir: Path, result_file: Path | None = None) -> Path:
    from servelab.bench.report import plot_serve, summary_rows
    from servelab.bench.results import write_results

    out_dir = result_dir / name
    json_path, _ = write_results(name, result, summary_rows(result), out_dir=out_dir)
    plot_serve(result, out_dir)
    if result_file is not None:
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.write_text(json_path.read_text())
    return out_dir


def run(args: argparse.Namespace) -> int:
    from servelab.bench.report import format_summary

    slos = parse_goodput(args.goodput)
    tokenizer = load_tokenizer(args.tokenizer)
    client = client_from_args(args, args.base_url, args.api_key, args.model)
    requests = requests_from_args(args, tokenizer)
    metrics = run_benchmark(client, requests, tokenizer, args.max_concurrency, slos, not args.disable_tqdm)
    result = {**run_info(args, client, tokenizer), **metrics}
    out_dir = save_result(result, args.name or f"serve-{time.strftime('%Y%m%d-%H%M%S')}", args.result_dir,
                          args.result_file)
    print(format_summary(result))
    print(f"results: {out_dir}" + (f" and {args.result_file}" if args.result_file else ""))
    return 0
