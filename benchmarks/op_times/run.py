"""Where an engine step's time goes: every servelab CPU op and int8 GEMM (`int8_matmul`) wrapped with a timer.

The burst (64 requests of 128 random prompt tokens, 64 output tokens, ignore_eos) is queued; the engine takes
12 steps (the prompts' prefill, mixed with the first decodes) and then times 5 decode steps at batch 64, or,
with `prefill`, a warm-up burst first and then the first 4 steps of a fresh one (1,024 prompt tokens each). Prints
ms per step by op; "rest" is Python, sampling and everything not wrapped. A W8A8 decode step is timed on the
layer-by-layer path (the engine's one-call path runs the same ops from C++, out of a timer's reach, and prefetches
the next matrices during attention, which the layer-by-layer path does not).

    python benchmarks/op_times/run.py [int8|gguf|none] [batch] [decode|prefill] [auto|int8 (--kv-cache-dtype)]
"""
from __future__ import annotations

import collections
import random
import sys
import time

import servelab.kernels as kernels
import servelab.model.llama as llama
import servelab.model.quant.quantization as quantization
from servelab.llm import LLM
from servelab.sampling_params import SamplingParams


class TimedOps:
    """Wraps a compiled ops module: every function call is timed into totals[name]."""

    def __init__(self, ops, totals: dict, counts: dict) -> None:
        self._ops, self._totals, self._counts = ops, totals, counts

    def __getattr__(self, name: str):
        fn = getattr(self._ops, name)
        if not callable(fn) or name[0].isupper():
            return fn

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._totals[name] += time.perf_counter() - start
            self._counts[name] += 1
            return out
        return timed


def queue_burst(engine, seed: int, batch: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    for _ in range(batch):
        prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]}
        engine.add_request(engine.input_processor.process_inputs(engine.new_request_id(), prompt, params))


def main() -> None:
    quant = sys.argv[1] if len(sys.argv) > 1 else "int8"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    phase = sys.argv[3] if len(sys.argv) > 3 else "decode"
    kv_cache_dtype = sys.argv[4] if len(sys.argv) > 4 else "auto"
    llm = LLM(quantization=None if quant == "none" else quant, max_num_seqs=batch, max_num_batched_tokens=1024,
              kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    model = engine.executor.model
    if model.ops is None:
        sys.exit("this model runs PyTorch's ops (servelab's CPU ops are for bf16 weights): nothing to wrap")
    if phase == "prefill":  # a whole burst first: kernels, caches and allocator warm
        queue_burst(engine, seed=99, batch=batch)
        while engine.has_unfinished_requests():
            engine.step()
    queue_burst(engine, seed=0, batch=batch)
    if phase == "decode":
        for _ in range(12):
            engine.step()
    # A W8A8 decode step runs its layers' ops from C++ in one call (w8a8_decode_layers), where no timer reaches:
    # time the layer-by-layer path, the same ops in the same order (its Python between them shows in "rest").
    model._w8a8_layers = None
    totals, counts = collections.defaultdict(float), collections.Counter()
    model.ops = TimedOps(model.ops, totals, counts)
    kernels.cpu_ops = lambda: model.ops  # Int8Weight looks the module up at each call
    plain_matmul = quantization.int8_matmul

    def timed_matmul(a, b):
        start = time.perf_counter()
        out = plain_matmul(a, b)
        totals["int8_matmul"] += time.perf_counter() - start
        counts["int8_matmul"] += 1
        return out
    quantization.int8_matmul = llama.int8_matmul = timed_matmul
    steps = 5 if phase == "decode" else 4
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step = (time.perf_counter() - start) / steps
    print(f"{phase} step {step * 1e3:.1f} ms ({quant}, batch {batch})")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{name:36s} {seconds / steps * 1e3:8.2f} ms/step  {counts[name] // steps} calls")
    print(f"{'rest':36s} {(step - sum(totals.values()) / steps) * 1e3:8.2f}")


if __name__ == "__main__":
    main()
