"""Timing the real engine's steps on this machine for the `local-cpu` profile (`servelab lab profile`).

Two measurements, both on the engine `servelab serve` would build with the same flags:
1. Step grid: StepPlans of chosen shapes (decode batches x context lengths, prefill chunks x earlier
   context, several prompts in one step, decodes mixed with a prefill chunk) run through the real
   ModelExecutor; the best of a few runs of each. fit.fit_steps turns them into the cost
   model's curves and constants.
2. Serving overhead (lab/serving_overhead.py): what `servelab serve` and a streaming client on the
   same machine add to each step, which the cost model adds as its per-step and per-request overhead.
"""
from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable

from servelab.core.block_manager import BlockManager
from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.lab.calibrate.fit import (StepFit, TimedStep, StepShape, fitted_device, fitted_efficiency,
                                        step_sample)
from servelab.lab.catalog.cpu_profile import CpuProfile, model_shape
from servelab.sampling_params import SamplingParams
from servelab.specs import ModelSpec, kv_dtype

DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DECODE_CONTEXTS = (32, 512)
LONG_CONTEXT, LONG_CONTEXT_BATCHES = 1536, (1, 8, 32)
PREFILL_CHUNKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
PREFILL_CONTEXT = 512
# chunks after a long cached context (chunked prefill of a long prompt, a long prefix hit): attention over the
# cache, not the chunk's own weights, is most of such a step, and the shorter shapes do not pin its cost down
LONG_PREFILLS = ((1536, 512), (3072, 256))  # (cached tokens, chunk)
MULTI_PREFILLS = ((4, 64), (16, 32), (32, 32), (8, 128))  # (prompts, tokens each) in one step
MIXED = ((8, 128), (16, 256), (31, 512), (31, None))  # (decodes, prefill chunk; None: rest of the budget)
MIXED_DECODE_CONTEXT = 128


@dataclass(frozen=True)
class ProfileSettings:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_blocks: int
    block_size: int


def step_grid(s: ProfileSettings, quick: bool = False) -> list[StepShape]:
    """The shapes to time, limited to what the engine's settings and KV pool allow."""
    batches = [b for b in DECODE_BATCHES if b <= s.max_num_seqs]
    chunks = [n for n in PREFILL_CHUNKS if n <= s.max_num_batched_tokens]
    if quick:
        batches, chunks = batches[::3], chunks[::2]
    grid: list[StepShape] = []
    for b in batches:
        grid += [[(c, 1, True)] * b for c in DECODE_CONTEXTS]
        if b in LONG_CONTEXT_BATCHES and not quick:
            grid.append([(LONG_CONTEXT, 1, True)] * b)
    for n in chunks:
        grid.append([(0, n, False)])
        if n in (16, 128):
            grid.append([(0, n, True)])
        if n in (64, 256):
            grid.append([(PREFILL_CONTEXT, n, False)])
    for computed, n in LONG_PREFILLS:
        if n <= s.max_num_batched_tokens:
            grid.append([(computed, n, True)])
    for count, n in MULTI_PREFILLS:
        if count <= s.max_num_seqs and count * n <= s.max_num_batched_tokens:
            grid.append([(0, n, True)] * count)
    for decodes, n in MIXED:
        n = s.max_num_batched_tokens - decodes if n is None else n
        if decodes + 1 <= s.max_num_seqs and 0 < decodes + n <= s.max_num_batched_tokens:
            grid.append([(MIXED_DECODE_CONTEXT, 1, True)] * decodes + [(0, n, True)])
    return [g for g in grid if _fits(g, s)]


def _fits(shape: StepShape, s: ProfileSettings) -> bool:
    blocks = sum(-(-(c + n) // s.block_size) for c, n, _ in shape)
    return blocks <= s.num_blocks and all(c + n < s.max_model_len for c, n, _ in shape)


class StepTimer:
    """Runs StepPlans of given shapes on a real ModelExecutor, with blocks from a scratch BlockManager
    over its KV pool (the KV contents do not change the time a step takes)."""

    def __init__(self, executor, block_size: int, vocab_size: int) -> None:
        self.executor = executor
        self.block_manager = BlockManager(executor.num_blocks, block_size)
        self.params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.vocab_size = vocab_size
        self._next_id = 0

    def time(self, shape: StepShape) -> float:
        """Seconds of one step of this shape."""
        plan, ids, bm = StepPlan(), [], self.block_manager
        for computed, n, sample in shape:
            request_id = f"profile-{self._next_id}"
            self._next_id += 1
            ids.append(request_id)
            if bm.allocate_slots(request_id, computed + n) is None:
                raise RuntimeError("the profile grid asked for more KV blocks than the pool has")
            tokens = [(7 + 31 * i) % self.vocab_size for i in range(computed + n)]
            plan.scheduled.append(ScheduledRequest(request_id, tokens[computed:], computed,
                                                   list(bm.block_tables[request_id]), sample, self.params,
                                                   tokens[:computed + 1], []))
        start = time.perf_counter()
        self.executor.execute(plan)
        seconds = time.perf_counter() - start
        for request_id in ids:
            bm.free(request_id)
        self.executor.execute(StepPlan(finished_request_ids=ids))
        return seconds


def measure_steps(engine, repeats: int = 3, quick: bool = False,
                  progress: Callable[[str], None] | None = None) -> list[TimedStep]:
    """Time the step grid on an LLMEngine's executor (built with the flags the user will serve with)."""
    cfg = engine.config
    settings = ProfileSettings(cfg.scheduler.effective_max_num_seqs, cfg.scheduler.max_num_batched_tokens,
                               cfg.scheduler.max_model_len, engine.executor.num_blocks, cfg.cache.block_size)
    timer = StepTimer(engine.executor, settings.block_size, cfg.model.vocab_size)
    grid = step_grid(settings, quick)
    timer.time(grid[0])  # warm-up: first-call allocations
    # Round after round over the whole grid, keeping each shape's median: a burst of other work on the
    # machine then spoils one run of a few shapes, not every run of the same shapes, and the median leaves
    # it out. Not the fastest: served steps run at the machine's typical speed, and `lab validate` compares
    # the lab with the median of real runs: on a VM whose speed drifts, the fastest made every simulated
    # stage's TPOT 8-13% too fast (README, "This machine as a lab device").
    times: list[list[float]] = [[] for _ in grid]
    for round_ in range(repeats):
        for i, shape in enumerate(grid):
            times[i].append(timer.time(shape))
        if progress:
            progress(f"round {round_ + 1}/{repeats}: {len(grid)} step shapes timed")
    return [step_sample(shape, statistics.median(t)) for shape, t in zip(grid, times)]


def build_profile(cfg, num_blocks: int, model: ModelSpec, samples: list[TimedStep], fit: StepFit,
                  overhead: dict) -> CpuProfile:
    """The CpuProfile (cfg: the profiled engine's EngineConfig, num_blocks its KV pool) of the fitted
    steps plus the serving overhead (see lab/serving_overhead.py)."""
    from servelab.executor.model_executor import os_total_memory

    quantization, kv_cache_dtype = cfg.quantization or "none", cfg.cache.cache_dtype
    device = fitted_device(fit, model, cfg.dtype, f"this machine's CPU ({_cpu_name()})", os_total_memory(),
                           quantization)
    efficiency = replace(fitted_efficiency(fit, model, device, cfg.dtype, kv_cache_dtype),
                         overhead_curve=overhead["curve"], arrival_overhead_s=overhead.get("arrival_s", 0.0))
    kv_bytes_per_token = model.kv_bytes_per_token(kv_dtype(cfg.dtype, kv_cache_dtype))
    return CpuProfile(
        device=device, efficiency=efficiency, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=num_blocks * cfg.cache.block_size * kv_bytes_per_token, dtype=cfg.dtype,
        max_num_seqs=cfg.scheduler.effective_max_num_seqs, max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        fit={"model": model.id, "model_shape": model_shape(model), "block_size": cfg.cache.block_size,
             "num_kv_blocks": num_blocks, "num_samples": len(samples),
             "mean_abs_rel_error": fit.mean_abs_rel_error, "max_abs_rel_error": fit.max_abs_rel_error,
             "serving": {k: v for k, v in overhead.items() if k != "curve"},
             "steps": [_step_json(s) for s in samples]},
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), host=f"{socket.gethostname()} ({_cpu_name()}, "
        f"{os.cpu_count()} CPUs, torch threads {_torch_threads()})")


def _step_json(s: TimedStep) -> dict:
    t = s.totals
    return {"tokens": t.num_tokens, "sampled": t.num_sampled, "requests": t.num_requests, "pairs": t.num_pairs,
            "kv_tokens": t.num_kv_tokens, "seconds": s.seconds}


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
