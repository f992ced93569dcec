"""`servelab bench peers`: servelab next to llama.cpp's server and Hugging Face transformers on this CPU,
the same seeded requests for every peer, and this machine's roofline measured in the same run.

Workloads (every request ignore_eos, greedy, token-id prompts):
  burst    N requests of 128 in / 64 out, all at t=0               -> output tokens/s
  poisson  the same requests arriving at 2 req/s (Poisson)          -> TTFT p99
  offline  N requests of 64-256 in / 32-128 out, all queued at once: servelab's offline engine
           (LLM.generate's loop) vs HF generate                     -> output tokens/s
  decode   one stream, 64 tokens: llama-bench tg64 vs servelab at batch 1 -> tokens/s
llama-server runs the default model's own GGUF (Q4_1) and a Q8_0 re-quantization, 16 and 64 slots,
-fa on, a context that holds every slot, threads = cores; servelab runs `servelab serve` with its
defaults and with each --quantization mode asked for. Every (server, workload) pair gets a fresh server, and random prompts share no prefix, so no prompt is
served from a cache (beyond the first request's hit on the client's probe).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from servelab.bench.peers.workloads import build_workloads
from servelab.bench.results import DEFAULT_DIR

PEERS = ("servelab", "llama.cpp", "hf")


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="servelab vs llama.cpp's server and HF transformers on the same workloads, "
                                     "with this CPU's roofline")
    p.add_argument("--only", default=",".join(PEERS), help="comma-separated peers from servelab,llama.cpp,hf")
    p.add_argument("--quick", action="store_true", help="16 requests per workload and short timings (smoke test)")
    p.add_argument("--skip-build", action="store_true",
                   help="do not build llama.cpp: use the cached build, or fail")
    p.add_argument("--llama-cpp-dir", type=Path, default=None, help="an existing build (llama-server, "
                   "llama-bench, llama-quantize in DIR, DIR/bin or DIR/build/bin)")
    p.add_argument("--llama-cpp-version", default=None, help="llama-cpp-python sdist to build llama.cpp from")
    p.add_argument("--build-jobs", type=int, default=None, help="parallel compile jobs (default: cores, at most 8)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of every peer (llama.cpp -t/-tb, "
                   "servelab --num-threads, torch for HF and the roofline); default: every core")
    p.add_argument("--quantization", default="default,none,gguf,int8",
                   help="servelab's --quantization modes to run, comma-separated from default,none,gguf,int8, "
                        "each optionally with +kv-int8 (run with --kv-cache-dtype int8, e.g. int8+kv-int8) "
                        "(default: servelab serve with no flags, i.e. --quantization auto)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--name", default=None, help="results go to <result-dir>/peers-<name>/")
    p.add_argument("--result-dir", type=Path, default=DEFAULT_DIR)
    p.set_defaults(func=run)


def parse_only(text: str) -> list[str]:
    peers = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in peers if s not in PEERS]
    if not peers or unknown:
        raise ValueError(f"--only takes a comma-separated list from {', '.join(PEERS)}, got {text!r}")
    return peers


KV_INT8_SUFFIX = "+kv-int8"  # a mode run with --kv-cache-dtype int8, e.g. int8+kv-int8


def parse_quantization(text: str) -> list[tuple[str | None, str]]:
    """Modes as (--quantization or None, --kv-cache-dtype): default (no flags: "auto"), none, gguf, int8, each
    optionally + kv-int8."""
    from servelab.config import QUANTIZATION_METHODS

    modes = [s.strip() for s in text.split(",") if s.strip()]
    parsed = [(m.removesuffix(KV_INT8_SUFFIX), "int8" if m.endswith(KV_INT8_SUFFIX) else "auto") for m in modes]
    unknown = [m for m, (q, _) in zip(modes, parsed) if q not in ("default", "none", *QUANTIZATION_METHODS)]
    if not modes or unknown:
        raise ValueError(f"--quantization takes a comma-separated list from default, none, "
                         f"{', '.join(QUANTIZATION_METHODS)}, each optionally with {KV_INT8_SUFFIX} "
                         f"(--kv-cache-dtype int8), got {text!r}")
    return [({"none": None, "default": "auto"}.get(q, q), kv) for q, kv in parsed]


def result_name(name: str | None) -> str:
    name = name or time.strftime("%Y%m%d-%H%M%S")
    return name if name.startswith("peers-") else f"peers-{name}"


def num_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def llama_cpp_tools(args: argparse.Namespace):
    from servelab.bench.peers.llama_cpp_build import LLAMA_CPP_PYTHON_VERSION, ensure_llama_cpp, existing_tools
    from servelab.model.loader import default_gguf_path

    if args.llama_cpp_dir is not None:
        return existing_tools(args.llama_cpp_dir)
    version = args.llama_cpp_version or LLAMA_CPP_PYTHON_VERSION
    return ensure_llama_cpp(version, args.build_jobs, gguf=default_gguf_path(), allow_build=not args.skip_build)


def add_roofline_shares(runs: list[dict], bandwidth_gbs: float) -> None:
    """Decode at batch 1 reads every weight once per token: bandwidth / weight bytes bounds its tokens/s."""
    for r in runs:
        if r["kind"] == "decode" and r.get("weight_bytes"):
            r["roofline_tokens_per_s"] = bandwidth_gbs * 1e9 / r["weight_bytes"]
            r["roofline_share"] = r["output_throughput"] / r["roofline_tokens_per_s"]


def run(args: argparse.Namespace) -> int:
    from servelab.bench.datasets import load_tokenizer
    from servelab.bench.peers.report import cpu_summary, table_rows, write_peers
    from servelab.bench.peers.runs import (run_hf, run_llama_cpp, run_servelab_gguf_decode, run_servelab_offline,
                                           run_servelab_online)
    from servelab.bench.results import markdown_table
    from servelab.bench.peers.roofline import linear_shapes, measure_roofline
    from servelab.model.loader import DEFAULT_MODEL, resolve_model_path

    start = time.perf_counter()
    peers = parse_only(args.only)
    quantizations = parse_quantization(args.quantization)
    name = result_name(args.name)
    tools = llama_cpp_tools(args) if "llama.cpp" in peers else None  # build first: a failed build fails fast
    tokenizer = load_tokenizer(None)
    num = 16 if args.quick else 64
    work = build_workloads(tokenizer, num, num, args.seed)
    threads = args.threads or num_threads()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    config = json.loads((resolve_model_path(None) / "config.json").read_text())
    print("roofline: GEMMs on the model's shapes and read bandwidth", flush=True)
    roofline = measure_roofline(linear_shapes(config), min_time_s=0.1 if args.quick else 0.5,
                                bandwidth_bytes=(1 << 28) if args.quick else (1 << 30))
    runs, llama_info = [], {}
    with tempfile.TemporaryDirectory(prefix="servelab-peers-") as log_dir:
        if tools is not None:
            llama_runs, llama_info = run_llama_cpp(args, tools, work, tokenizer, Path(log_dir), threads)
            runs += llama_runs
        if "servelab" in peers:
            for quantization, kv_cache_dtype in quantizations:
                runs += run_servelab_online(args, work, tokenizer, Path(log_dir), quantization, kv_cache_dtype)
                runs += run_servelab_offline(args, work, quantization, kv_cache_dtype)
            for gguf_type, gguf in llama_info.get("ggufs", {}).items():  # llama.cpp's copies, same weights
                if ("gguf", "auto") in quantizations and gguf_type != "Q4_1":
                    runs.append(run_servelab_gguf_decode(args, work, Path(gguf), gguf_type))
    if "hf" in peers:
        runs += run_hf(work, tokenizer)
    order = ("burst", "poisson", "offline", "decode")
    runs.sort(key=lambda r: order.index(r["kind"]))  # stable: peers keep their order within a workload
    add_roofline_shares(runs, roofline["read_bandwidth_gbs"])
    result = {"model": DEFAULT_MODEL, "cpu": cpu_summary(), "num_threads": threads, "seed": args.seed,
              "quick": args.quick, "workloads": work.labels, "roofline": roofline, "llama_cpp": llama_info,
              "runs": runs, "wall_s": time.perf_counter() - start,
              "command": "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    json_path, _ = write_peers(name, result, args.result_dir / name)
    print(markdown_table(table_rows(runs)))
    print(f"results: {json_path.parent} ({result['wall_s'] / 60:.1f} min)")
    failed = [f"{r['engine']} {r['config']} {r['kind']}: {r.get('error_counts')}" for r in runs if r.get("failed")]
    for line in failed:  # a comparison with failed requests is not like for like
        print(f"failed requests: {line}", file=sys.stderr)
    return 1 if failed else 0
