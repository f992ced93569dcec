"""The peers of `servelab bench peers`, each run on the workloads: llama.cpp (llama-bench, then
llama-server per GGUF type and slot count), servelab (`servelab serve`, then the offline engine in this
process) and HF transformers (offline generate in this process)."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import shlex
import time
from pathlib import Path

from servelab.bench.datasets import BenchRequest

from servelab.bench.peers.workloads import Workloads

SLOT_COUNTS = (16, 64)


def online_run(kind: str, label: str, peer: str, engine: str, config: str, server_url: str, model_id: str,
               requests: list[BenchRequest], tokenizer, show_progress: bool) -> dict:
    from servelab.bench.loadgen import ClientConfig
    from servelab.bench.serve import run_benchmark

    client = ClientConfig(base_url=server_url, model=model_id, ignore_eos=True)
    result = run_benchmark(client, requests, tokenizer, None, None, show_progress, desc=f"{engine} {config} {kind}")
    return {"workload": label, "kind": kind, "peer": peer, "engine": engine, "config": config,
            **{k: v for k, v in result.items() if k != "itls"}}


def run_llama_cpp(args, tools, work: Workloads, tokenizer, log_dir: Path, threads: int) -> tuple[list, dict]:
    from servelab.bench.peers.llama_cpp_build import cache_dir
    from servelab.bench.peers.llama_cpp_runs import (LlamaServer, free_port, quantized_copy, run_llama_bench,
                                               server_command, slot_context)
    from servelab.model.loader import default_gguf_path

    source = default_gguf_path()
    ggufs = {"Q4_1": source, "Q8_0": quantized_copy(tools, source, "Q8_0", cache_dir().parent / "models", threads)}
    runs = []
    for gguf_type, gguf in ggufs.items():
        bench = run_llama_bench(tools, gguf, work.decode_tokens, threads, 2 if args.quick else 5)
        runs.append({"workload": work.labels["decode"], "kind": "decode", "peer": "llama.cpp", "engine": "llama.cpp",
                     "config": f"{gguf_type} GGUF, llama-bench", "output_throughput": bench["tokens_per_s"],
                     "weight_bytes": gguf.stat().st_size, **bench})
    slot_ctx = slot_context(max(r.prompt_len + r.output_len for r in work.burst))
    for gguf_type, gguf in ggufs.items():
        for num_slots in SLOT_COUNTS:
            config = f"{gguf_type} GGUF, {num_slots} slots"
            for kind in ("burst", "poisson"):
                port = free_port()
                command = server_command(tools, gguf, port, num_slots, slot_ctx, threads, "llama.cpp")
                print(f"llama.cpp {config} {kind}: {shlex.join(command)}", flush=True)
                log = log_dir / f"llama-server-{gguf_type}-{num_slots}-{kind}.log"
                with LlamaServer(command, port, log, args.server_timeout) as server:
                    runs.append({**online_run(kind, work.labels[kind], "llama.cpp", "llama.cpp", config, server.url,
                                              "llama.cpp", getattr(work, kind), tokenizer, not args.disable_tqdm),
                                 "server_command": command})
    return runs, {"ggufs": {k: str(v) for k, v in ggufs.items()}, "bin_dir": str(tools.bin_dir), "build": tools.build,
                  "slot_context": slot_ctx}


def quantization_label(quantization: str | None, kv_cache_dtype: str = "auto") -> str:
    """quantization None is `--quantization none`; "auto" is servelab's default."""
    flags = ([] if quantization == "auto" else [f"--quantization {quantization or 'none'}"]) + (
        [] if kv_cache_dtype == "auto" else [f"--kv-cache-dtype {kv_cache_dtype}"])
    return ", ".join(flags) or "default flags"


def run_servelab_online(args, work: Workloads, tokenizer, log_dir: Path, quantization: str | None,
                        kv_cache_dtype: str = "auto") -> list[dict]:
    from servelab.bench.loadgen import first_model_id
    from servelab.bench.stages import ServelabServer

    runs = []
    flags = ["--log-level", "warning"]  # otherwise servelab serve's defaults
    if args.threads:
        flags += ["--num-threads", str(args.threads)]
    if quantization != "auto":
        flags += ["--quantization", quantization or "none"]
    if kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", kv_cache_dtype]
    for kind in ("burst", "poisson"):
        print(f"servelab {kind}: servelab serve {shlex.join(flags)}", flush=True)
        log = log_dir / f"servelab-{quantization or 'none'}-kv-{kv_cache_dtype}-{kind}.log"
        with ServelabServer(None, flags, log, args.server_timeout) as server:
            model_id = asyncio.run(first_model_id(server.url))
            runs.append({**online_run(kind, work.labels[kind], "servelab", "servelab",
                                      f"serve, {quantization_label(quantization, kv_cache_dtype)}", server.url, model_id,
                                      getattr(work, kind), tokenizer, not args.disable_tqdm),
                         "server_flags": flags})
    return runs


def servelab_decode(engine, num_tokens: int, num_iters: int, prompt_token_id: int = 1000) -> float:
    """Tokens/s of one stream from a one-token prompt: num_tokens decode steps after the first token,
    the median of num_iters runs after a warm-up (what llama-bench's tgN measures)."""
    from servelab.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=num_tokens + 1, ignore_eos=True, temperature=0.0)
    times = []
    for it in range(num_iters + 1):
        engine.add_request(engine.input_processor.process_inputs(f"peers-decode-{it}", {"prompt_token_ids": [prompt_token_id]},
                                                                 params))
        first = None
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and outs:
                first = time.perf_counter()
        if it:
            times.append(time.perf_counter() - first)
    return num_tokens / sorted(times)[len(times) // 2]


def generate_offline(engine, requests: list[BenchRequest], prefix: str) -> float:
    """Every request queued at once, then stepped to the end (LLM.generate's loop); returns seconds."""
    from servelab.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        engine.add_request(engine.input_processor.process_inputs(f"{prefix}-{i}", {"prompt_token_ids": r.prompt},
                                                                 params))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def decode_row(args, work: Workloads, engine, config: str, dtype) -> dict:
    """The single-stream decode row of an engine: servelab_decode's tokens/s and the stored weight bytes
    (quantized blocks count as stored), for the roofline share."""
    tps = servelab_decode(engine, work.decode_tokens, 1 if args.quick else 3)
    return {"workload": work.labels["decode"], "kind": "decode", "peer": "servelab", "engine": "servelab",
            "config": config, "output_throughput": tps, "weight_bytes": engine.executor.weight_bytes,
            "dtype": str(dtype)}


def run_servelab_offline(args, work: Workloads, quantization: str | None, kv_cache_dtype: str = "auto") -> list[dict]:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine_args import EngineArgs

    # LLM()'s defaults
    engine = LLMEngine.from_engine_args(EngineArgs(num_threads=args.threads, quantization=quantization,
                                                   kv_cache_dtype=kv_cache_dtype))
    dtype = f"{engine.config.dtype}, {quantization_label(quantization, kv_cache_dtype)}"
    if quantization == "auto":
        choice = engine.quantization_choice
        dtype += f" (auto: {choice.mode}, KV {choice.kv_cache_dtype})"
    generate_offline(engine, [dataclasses.replace(r, output_len=4) for r in work.offline[:2]], "peers-warmup")
    elapsed = generate_offline(engine, work.offline, "peers-offline")
    offline = {"workload": work.labels["offline"], "kind": "offline", "peer": "servelab", "engine": "servelab",
               "config": f"offline engine, {dtype}", "output_throughput": sum(r.output_len for r in work.offline)
               / elapsed, "duration": elapsed, "completed": len(work.offline), "failed": 0, "dtype": str(dtype)}
    on_file = ", Q4_1 GGUF" if quantization == "gguf" else ""  # the default model's file
    decode = decode_row(args, work, engine, f"batch 1, {dtype}{on_file}", dtype)
    del engine
    gc.collect()
    return [offline, decode]


def run_servelab_gguf_decode(args, work: Workloads, gguf: Path, gguf_type: str) -> dict:
    """servelab's batch-1 decode on another GGUF file (llama.cpp's Q8_0 copy of the default model), so that
    every llama-bench row has a servelab row on the same weights."""
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine_args import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(gguf), num_threads=args.threads, quantization="gguf"))
    dtype = engine.config.dtype
    row = decode_row(args, work, engine, f"batch 1, {dtype}, --quantization gguf, {gguf_type} GGUF", dtype)
    del engine
    gc.collect()
    return row


def run_hf(work: Workloads, tokenizer) -> list[dict]:
    """HF generate on every offline request in one left-padded batch, in its fastest dtype on this CPU
    (fp32 or bf16, timed on a small batch first)."""
    import torch

    from servelab.bench.offline.hf_baseline import run_hf_static
    from servelab.model.loader import resolve_model_path

    folder, pad = resolve_model_path(None), tokenizer.eos_token_ids[0]
    prompts = [r.prompt for r in work.offline]
    outs = [r.output_len for r in work.offline]
    trial = {name: run_hf_static(folder, getattr(torch, name), [p[:32] for p in prompts[:4]], [8] * 4, 4, pad)
             for name in ("float32", "bfloat16")}
    dtype = min(trial, key=lambda name: trial[name]["elapsed_s"])
    batch_size = len(prompts)
    timings = ", ".join(f"{k} {v['elapsed_s']:.2f} s" for k, v in trial.items())
    print(f"hf transformers: {dtype} (trial: {timings}), static batches of {batch_size}", flush=True)
    hf = run_hf_static(folder, getattr(torch, dtype), prompts, outs, batch_size, pad)
    return [{"workload": work.labels["offline"], "kind": "offline", "peer": "hf", "engine": "hf transformers",
             "config": f"generate, {dtype}, batch {batch_size}", "output_throughput": hf["output_tokens"] / hf["elapsed_s"],
             "duration": hf["elapsed_s"], "completed": hf["num_requests"], "failed": 0, "dtype": dtype,
             "dtype_trial_s": {k: v["elapsed_s"] for k, v in trial.items()}}]
