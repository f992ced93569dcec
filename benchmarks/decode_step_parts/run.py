"""The batch-64 W8A8 decode step's parts, each measured on its own (issue 13's "batched steps at >= 60% of the
roofline": what is left between the step and its GEMMs).

1. attention: one layer's int8-KV decode attention, 64 sequences x 160 tokens (SmolLM2's 9 query / 3 KV heads of
   64), one thread, the same cache every call (4 MB: mostly from cache): ms per call, ns per (token, KV head).
   attention-dram: the same shape on all threads, 30 layers' caches in turn (KV from DRAM, as in a step), int8 and
   bf16 KV, with and without the side prefetch of the next matrices, against one layer's cache repeated.
2. gemm: the 30 layers' four int8 matrices at M = 64 through torch._int_mm, every layer its own weights (they
   stream from DRAM, as in a step) against one layer's weights 30 times (from cache).
3. prefetch: engine decode steps at batch 64 (W8A8, int8 KV, all layers in one call), the attention prefetching the
   layer's next matrices on one step and not on the next (the model's prefetch_weights), alternating in one
   process: the median step of each.

Usage: python benchmarks/decode_step_parts/run.py [--parts attention,attention-dram,gemm,prefetch] [--out FILE]
Run it on a quiet machine; this VM's speed drifts by tens of percent between minutes, so each part compares its
two sides within the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch


def attention_part(calls: int = 1500) -> dict:
    from servelab.kernels import cpu_ops
    from servelab.model.attention import quantize_kv

    ops = cpu_ops()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batch, ctx, block, kv_heads, head_dim, heads = 64, 160, 16, 3, 64, 9
        torch.manual_seed(0)
        cache = quantize_kv(torch.randn(2, 700, block, kv_heads, head_dim).to(torch.bfloat16))
        blocks = -(-ctx // block)
        tables = torch.randperm(700)[:batch * blocks].view(batch, blocks)
        lens = torch.full((batch,), ctx, dtype=torch.long)
        q = torch.randn(batch, heads * head_dim)
        ops.paged_decode_attention(q, cache, tables, lens, heads)
        start = time.perf_counter()
        for _ in range(calls):
            ops.paged_decode_attention(q, cache, tables, lens, heads)
        seconds = (time.perf_counter() - start) / calls
    finally:
        torch.set_num_threads(threads)
    return {"ms_per_layer": seconds * 1e3, "ns_per_token_kv_head": seconds / (batch * kv_heads * ctx) * 1e9}


def attention_dram_part(rounds: int = 10, layers: int = 30) -> dict:
    """One decode step's attention as the engine runs it: 30 layers' caches (each layer's KV from DRAM; 4.2 MB a
    layer at int8, 7.9 MB at bf16), 64 sequences x 160 tokens in consecutive blocks, the machine's threads, with and
    without the 3.5 MB of next matrices that the one-call step prefetches alongside; against one layer's cache
    every call (from cache). ms per layer call, median of the rounds."""
    from servelab.kernels import cpu_ops
    from servelab.model.attention import quantize_kv

    ops = cpu_ops()
    batch, ctx, block, kv_heads, head_dim, heads = 64, 160, 16, 3, 64, 9
    blocks = -(-ctx // block)
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), ctx, dtype=torch.long)
    torch.manual_seed(0)
    q = torch.randn(batch, heads * head_dim)
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    weights = [[torch.randint(-127, 127, (n, k), dtype=torch.int8) for k, n in shapes] for _ in range(layers)]
    out = {}
    for kv in ("int8", "bfloat16"):
        raw = [torch.randn(2, batch * blocks + 8, block, kv_heads, head_dim) for _ in range(layers)]
        caches = [quantize_kv(c) if kv == "int8" else c.to(torch.bfloat16) for c in raw]
        del raw
        runs = {"dram": (range(layers), False), "dram+prefetch": (range(layers), True), "cache": ([0] * layers, False)}
        times = {name: [] for name in runs}
        for _ in range(rounds):
            for name, (order, side) in runs.items():
                start = time.perf_counter()
                for layer in order:
                    ops.paged_decode_attention(q, caches[layer], tables, lens, heads,
                                               weights[(layer + 1) % layers] if side else [])
                times[name].append((time.perf_counter() - start) / layers * 1e3)
        out[kv] = {name: {"ms_per_layer": statistics.median(v)} for name, v in times.items()}
    out["threads"] = torch.get_num_threads()
    return out


def gemm_part(m: int = 64, layers: int = 30, repeats: int = 3) -> dict:
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate_up, down (k, n)
    torch.manual_seed(0)
    weights = [[torch.randint(-127, 127, (n, k), dtype=torch.int8) for k, n in shapes] for _ in range(layers)]
    inputs = [torch.randint(-127, 127, (m, k), dtype=torch.int8) for k, _ in shapes]
    flops = layers * sum(2.0 * m * k * n for k, n in shapes)

    def run(stack):
        for layer in stack:
            for w, x in zip(layer, inputs):
                torch._int_mm(x, w.t())

    out = {"dram": [], "cache": []}
    for _ in range(repeats):
        for name, stack in (("dram", weights), ("cache", [weights[0]] * layers)):
            run(stack)
            start = time.perf_counter()
            run(stack)
            out[name].append(time.perf_counter() - start)
    return {name: {"ms": statistics.median(v) * 1e3, "gflops": flops / statistics.median(v) / 1e9}
            for name, v in out.items()}


def prefetch_part(batch: int = 64, rounds: int = 3) -> dict:
    from servelab.llm import LLM
    from servelab.sampling_params import SamplingParams

    llm = LLM(quantization="int8", max_num_seqs=batch, max_num_batched_tokens=1024, kv_cache_dtype="int8")
    engine = llm.engine
    model = engine.executor.model
    steps = {True: [], False: []}
    default = model.prefetch_weights
    try:
        for r in range(rounds):
            rng = random.Random(r)
            params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
            for _ in range(batch):
                prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]}
                engine.add_request(engine.input_processor.process_inputs(engine.new_request_id(), prompt, params))
            i = 0
            while engine.has_unfinished_requests():
                model.prefetch_weights = i % 2 == 0
                engine.step()
                s = engine.last_step_stats
                if r and s is not None and s.num_prefill_tokens == 0 and s.num_decode_requests == batch:
                    steps[model.prefetch_weights].append(s.duration * 1e3)
                i += 1
    finally:
        model.prefetch_weights = default
    return {("on" if k else "off"): {"steps": len(steps[k]), "step_ms": statistics.median(steps[k])}
            for k in (True, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="attention,gemm,prefetch")
    parser.add_argument("--out", default=str(Path(__file__).with_name("decode_step_parts.json")))
    args = parser.parse_args()
    parts = {"attention": attention_part, "attention-dram": attention_dram_part, "gemm": gemm_part,
             "prefetch": prefetch_part}
    result = {"command": f"python benchmarks/decode_step_parts/run.py --parts {args.parts}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()}
    for name in args.parts.split(","):
        result[name] = parts[name]()
        print(name, json.dumps(result[name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
