"""`servelab bench stages`: the evolution path, measured. Starts `servelab serve` once per stage
(1 serial, 2 static batching, 3 continuous batching + paged KV, 4 the same over `-tp 3` worker processes,
5 prefill/decode disaggregated 1:1, 6 KV-cache-aware routing over `-dp 2 --router prefix`, beside `dp`: the same two
replicas behind the least-loaded router) on the same model, sends each the same seeded workload with
`bench serve`'s client, stops it, and writes one comparison table and plot.

Every stage gets the same --max-num-seqs (serial ignores it) and --server-args, `--request-timeout 0`
and admission limits that take the whole workload, so the stages differ only in their schedule.
Requests are sent with ignore_eos: every stage generates exactly the same number of tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from servelab.bench.server_process import ServerProcess
from servelab.bench.datasets import load_tokenizer
from servelab.bench.loadgen import ClientConfig, first_model_id
from servelab.bench.serve import (add_output_args, add_request_args, add_workload_args, parse_goodput,
                                  requests_from_args, run_benchmark)

STAGES = ("serial", "static", "continuous", "tp", "disaggregated")  # the default: the evolution path 1-5
# Stage 6 and the replicas it is compared with, on request (--stages dp,prefix): they need prompts that share
# prefixes (--dataset prefix-shared, or a trace with hash_ids).
ROUTING_STAGES = ("dp", "prefix")
ALL_STAGES = STAGES + ROUTING_STAGES
STAGE_LABELS = {"serial": "1 serial", "static": "2 static batching", "continuous": "3 continuous + paged",
                "tp": "4 tensor parallel -tp 3", "disaggregated": "5 disaggregated 1:1",
                "dp": "6a data parallel -dp 2, least-loaded", "prefix": "6 KV-aware routing -dp 2 --router prefix"}
# Stage 4's size: the default model's 9 attention heads and 3 KV heads split by 3.
STAGE4_TENSOR_PARALLEL_SIZE = 3
# Stages past 3 run continuous batching plus the flags that make them.
STAGE_FLAGS = {"tp": ["--tensor-parallel-size", str(STAGE4_TENSOR_PARALLEL_SIZE)],
               "disaggregated": ["--disaggregate", "1:1"],
               "dp": ["--data-parallel-size", "2", "--router", "least-loaded"],
               "prefix": ["--data-parallel-size", "2", "--router", "prefix"]}
BANNER = re.compile(r"servelab: serving \S+ at (http://\S+)/v1 ")
PREEMPTIONS = re.compile(r"^servelab:num_preemptions_total\{[^}]*\} (\S+)$", re.MULTILINE)
PREFIX_COUNTERS = {name: re.compile(rf"^servelab:prefix_cache_{name}_total\{{[^}}]*\}} (\S+)$", re.MULTILINE)
                   for name in ("queries", "hits")}


class ServelabServer(ServerProcess):
    """`servelab serve` on 127.0.0.1, any free port (read back from its banner), log to a file."""

    def __init__(self, model: str | None, flags: list[str], log_path: Path, startup_timeout_s: float) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.url = ""
        command = [sys.executable, "-m", "servelab.entrypoints.cli", "serve", *([model] if model else []),
                   "--host", "127.0.0.1", "--port", "0", *flags]
        self._start(command, log_path)

    def wait_ready(self) -> "ServelabServer":
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"servelab serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            match = self.url or BANNER.search(self.log_path.read_text(errors="replace"))
            if match:
                self.url = self.url or match[1]
                try:
                    if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"servelab serve not ready after {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    def _metrics_text(self) -> str | None:
        import httpx

        try:
            return httpx.get(f"{self.url}/metrics", timeout=10.0).text
        except httpx.HTTPError:
            return None

    def num_preemptions(self) -> int | None:
        text = self._metrics_text()
        match = PREEMPTIONS.search(text) if text is not None else None
        return int(float(match[1])) if match else None

    def prefix_cache_hit_rate(self) -> float | None:
        """Hit tokens over queried tokens, summed over the engine cores."""
        text = self._metrics_text()
        if text is None:
            return None
        queries, hits = (sum(float(v) for v in PREFIX_COUNTERS[n].findall(text)) for n in ("queries", "hits"))
        return hits / queries if queries else None


def add_parser(sub) -> None:
    p = sub.add_parser("stages", help="serve the same model in each evolution stage, same workload, compare")
    p.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated, from " + ",".join(ALL_STAGES))
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch slots of the static and continuous stages")
    p.add_argument("--server-args", default="", help='more `servelab serve` flags for every stage, e.g. '
                   '--server-args="--dtype float32 --num-threads 2"')
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--baseline", choices=("none", "hf"), default="none",
                   help="hf: also time Hugging Face generate in static batches on the same prompts (offline: "
                        "every request at t=0; throughput only)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: --max-num-seqs")
    p.add_argument("--hf-dtype", default="float32")
    add_workload_args(p, num_prompts=128)
    add_request_args(p)
    add_output_args(p)
    p.set_defaults(func=run, ignore_eos=True, input_len=128, output_len=128, range_ratio=0.5)


def stage_flags(stage: str, max_num_seqs: int, num_prompts: int, server_args: str) -> list[str]:
    flags = ["--schedule", "continuous", *STAGE_FLAGS[stage]] if stage in STAGE_FLAGS else ["--schedule", stage]
    if stage != "serial":
        flags += ["--max-num-seqs", str(max_num_seqs)]
    # Room for the whole workload in the queue and no request timeout: the serial stage's queue is long.
    flags += ["--request-timeout", "0", "--max-num-queued-requests", str(max(256, num_prompts)),
              "--max-queued-tokens", str(1 << 30), "--shutdown-grace", "5", "--log-level", "warning"]
    return flags + shlex.split(server_args)


def parse_stages(text: str) -> list[str]:
    stages = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in stages if s not in ALL_STAGES]
    if not stages or unknown:
        raise ValueError(f"--stages takes a comma-separated list from {', '.join(ALL_STAGES)}, got {text!r}")
    return stages


def run_stage(args: argparse.Namespace, stage: str, requests, tokenizer, slos: dict, log_dir: Path) -> dict:
    flags = stage_flags(stage, args.max_num_seqs, args.num_prompts, args.server_args)
    label = STAGE_LABELS[stage] + (f" (max-num-seqs {args.max_num_seqs})" if stage != "serial" else "")
    print(f"{label}: starting servelab serve {shlex.join(flags)}", flush=True)
    with ServelabServer(args.model, flags, log_dir / f"{stage}.log", args.server_timeout) as server:
        client = ClientConfig(base_url=server.url, endpoint=args.endpoint, model=_model_id(server.url),
                              ignore_eos=True)
        result = run_benchmark(client, requests, tokenizer, args.max_concurrency, slos, not args.disable_tqdm,
                               desc=label)
        preemptions = server.num_preemptions()
        hit_rate = server.prefix_cache_hit_rate()
    return {"stage": label, "schedule": stage, "model_id": client.model, "server_flags": flags,
            "num_preemptions": preemptions, "prefix_cache_hit_rate": hit_rate, **result}


def _model_id(url: str) -> str:
    return asyncio.run(first_model_id(url))


def run_hf(args: argparse.Namespace, requests, tokenizer) -> dict:
    import torch
    from tqdm import tqdm

    from servelab.bench.offline.hf_baseline import run_hf_static
    from servelab.model.loader import resolve_model_path

    prompts = [r.prompt if isinstance(r.prompt, list) else tokenizer.encode(r.prompt, add_special_tokens=False)
               for r in requests]
    batch_size = args.hf_batch_size or args.max_num_seqs
    with tqdm(total=len(prompts), desc="hf static", unit="req", disable=args.disable_tqdm) as bar:
        hf = run_hf_static(resolve_model_path(args.model), getattr(torch, args.hf_dtype), prompts,
                           [r.output_len for r in requests], batch_size, tokenizer.eos_token_ids[0], bar)
    return {"stage": f"hf transformers {args.hf_dtype} static batch {batch_size} (offline)", "schedule": "hf",
            "completed": hf["num_requests"], "failed": 0, "duration": hf["elapsed_s"],
            "request_throughput": hf["num_requests"] / hf["elapsed_s"],
            "output_throughput": hf["output_tokens"] / hf["elapsed_s"]}


def comparison_row(run: dict) -> dict:
    get = lambda key: run.get(key, "-")  # noqa: E731  (the HF row has throughput only)
    return {"stage": run["stage"], "completed": run["completed"], "failed": run["failed"],
            "duration s": run["duration"], "req/s": run["request_throughput"],
            "output tok/s": run["output_throughput"], "TTFT p50 ms": get("median_ttft_ms"),
            "TTFT p99 ms": get("p99_ttft_ms"), "TPOT p50 ms": get("median_tpot_ms"), "TPOT p99 ms": get("p99_tpot_ms"),
            "E2E p50 s": run["median_e2el_ms"] / 1000 if "median_e2el_ms" in run else "-",
            "peak in flight": get("max_concurrent_requests"), "preemptions": get("num_preemptions"),
            "prefix hit rate": "-" if run.get("prefix_cache_hit_rate") is None else run["prefix_cache_hit_rate"]}


def ratios(runs: list[dict]) -> dict:
    by = {r["schedule"]: r for r in runs}
    out = {}
    if "continuous" in by:
        for other in ("serial", "static", "hf"):
            if other in by:
                out[f"continuous_vs_{other}_output_throughput"] = (by["continuous"]["output_throughput"]
                                                                   / by[other]["output_throughput"])
        if "tp" in by:
            out["tp_vs_continuous_output_throughput"] = (by["tp"]["output_throughput"]
                                                         / by["continuous"]["output_throughput"])
        if "static" in by:
            out["continuous_vs_static_p99_ttft"] = by["continuous"]["p99_ttft_ms"] / by["static"]["p99_ttft_ms"]
        if "disaggregated" in by:
            out["disaggregated_vs_continuous_output_throughput"] = (by["disaggregated"]["output_throughput"]
                                                                    / by["continuous"]["output_throughput"])
    if "prefix" in by and "dp" in by:
        out["prefix_vs_dp_output_throughput"] = by["prefix"]["output_throughput"] / by["dp"]["output_throughput"]
        out["prefix_vs_dp_median_ttft"] = by["prefix"]["median_ttft_ms"] / by["dp"]["median_ttft_ms"]
    return out


def run(args: argparse.Namespace) -> int:
    from servelab.bench.report import plot_stages
    from servelab.bench.results import markdown_table, write_results
    from servelab.bench.serve import run_info

    stages, slos = parse_stages(args.stages), parse_goodput(args.goodput)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    requests = requests_from_args(args, tokenizer)
    name = args.name or f"stages-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = args.result_dir / name
    with tempfile.TemporaryDirectory(prefix="servelab-stages-") as log_dir:
        runs = [run_stage(args, stage, requests, tokenizer, slos, Path(log_dir)) for stage in stages]
    if args.baseline == "hf":
        runs.append(run_hf(args, requests, tokenizer))
    model_id = runs[0]["model_id"]
    plot_stages(runs, out_dir, f"{model_id}: {args.num_prompts} requests at {args.request_rate:g} req/s (input "
                f"{args.input_len}, output {args.output_len}, range ratio {args.range_ratio:g}), seed {args.seed}")
    rows = [comparison_row(r) for r in runs]
    info = run_info(args, ClientConfig(base_url="", endpoint=args.endpoint, model=model_id, ignore_eos=True),
                    tokenizer)
    info.update(max_num_seqs=args.max_num_seqs, server_args=args.server_args, input_len=args.input_len,
                output_len=args.output_len, range_ratio=args.range_ratio)
    # Per-token gaps are summarised in the *_itl_ms keys; the per-request lists keep the JSON small.
    payload = {**info, **ratios(runs), "runs": [{k: v for k, v in r.items() if k != "itls"} for r in runs]}
    json_path, _ = write_results(name, payload, rows, out_dir=out_dir)
    print(markdown_table(rows))
    for key, value in ratios(runs).items():
        print(f"{key}: {value:.2f}x")
    print(f"results: {json_path.parent}")
    failed = {r["stage"]: r.get("error_counts", {}) for r in runs if r["failed"]}
    for stage, errors in failed.items():  # a comparison with failed requests is not like for like
        print(f"{stage}: failed requests: {errors}", file=sys.stderr)
    return 1 if failed else 0
