"""Seeded workloads: when requests arrive and how long their prompts and outputs are.

Shared by the lab simulator and the load generator (`servelab bench serve`), so one seed gives the
same arrivals and lengths in both. Flags and their meaning follow `vllm bench serve`:
--request-rate (inf: all at t=0), --burstiness (gamma shape; 1 = Poisson), --range-ratio (lengths
uniform in [len*(1-r), len*(1+r)]).

prefix-shared is vLLM's prefix-repetition shape: num_prefixes prefixes of prefix_len tokens, each request
one of them (drawn uniformly) followed by its own suffix of input_len tokens. Its requests carry the
prefix they share (prefix_group), which the lab turns into token ids that hash alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from servelab import sharegpt_llama3
from servelab.errors import FieldError, check_fields
from servelab.rate_schedule import parse_rate_schedule
from servelab.trace_formats import TRACE_FORMATS, TraceError, read_trace

DATASETS = ("random", "sharegpt-like", "sharegpt-llama3", "prefix-shared")
# Where the gaps between arrivals come from. servelab: a stream of their own spawned from the seed (lengths and
# arrivals independent). numpy-legacy: numpy's legacy generator seeded with the seed, the gaps its first draws:
# vLLM's benchmarks/benchmark_serving.py draws each gap from numpy's global generator (np.random.seed(args.seed),
# then np.random.gamma(burstiness, 1 / (rate * burstiness)) per request, for burstiness 1 the same draw as its
# earlier np.random.exponential(1 / rate)), so a published run whose durations show that trace can be replayed.
ARRIVAL_RNGS = ("servelab", "numpy-legacy")
# vllm bench serve's random-dataset defaults.
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
# vllm bench serve's prefix-repetition defaults (prefix, suffix and output length, number of prefixes).
DEFAULT_PREFIX_LEN = 256
DEFAULT_SUFFIX_LEN = 256
DEFAULT_NUM_PREFIXES = 10

# ShareGPT-like lengths: lognormal fits to ShareGPT V3 conversations (first turn, Llama tokenizer):
# mean prompt ~160 tokens, mean output ~340 tokens, long right tails. Filtered like vLLM's ShareGPT
# sampler (sharegpt_llama3.filtered): both lengths >= 4, prompt <= 1024, prompt + output <= 2048.
SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA = 4.63, 1.05
SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA = 5.51, 0.90
# sharegpt-llama3: ShareGPT V3 as vLLM's and SGLang's benchmark samplers read it with Llama 3's tokenizer, drawn
# from the dataset's measured lengths (sharegpt_llama3.py).


@dataclass(frozen=True)
class WorkloadConfig:
    dataset: str = "random"
    num_prompts: int = 1000
    # None: the dataset's default (random: 1024 / 128; sharegpt-like: drawn from its distribution).
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0
    # A rate that changes over time (rate_schedule.py); it sets the arrivals and their number, replacing
    # request_rate and num_prompts.
    rate_schedule: str | None = None
    # prefix-shared only (None: the defaults above); input_len is then each request's own suffix.
    prefix_len: int | None = None
    num_prefixes: int | None = None
    arrival_rng: str = "servelab"  # one of ARRIVAL_RNGS
    # sharegpt-llama3 only: the run's outputs ended at the model's EOS (a client without --ignore-eos) and
    # averaged this many tokens; None: each output is the dataset's length (sharegpt_llama3.eos_cut)
    eos_mean_output: float | None = None
    # A public trace replayed instead of the dataset (trace_formats.py): its arrivals and lengths (and for
    # mooncake, its shared prompt blocks). time_scale multiplies every arrival time (0.5: twice as fast);
    # max_requests keeps the first N, sample draws N of them with the seed (in arrival order).
    trace: str | None = None
    trace_format: str | None = None
    time_scale: float = 1.0
    max_requests: int | None = None
    sample: int | None = None

    def __post_init__(self) -> None:
        check_fields([
            (self.dataset in DATASETS, f"{{dataset}} must be one of {', '.join(DATASETS)}, got {self.dataset!r}",
             ("dataset",)),
            (self.num_prompts >= 1, f"{{num_prompts}} must be >= 1, got {self.num_prompts}", ("num_prompts",)),
            (self.input_len is None or self.input_len >= 1, f"{{input_len}} must be >= 1, got {self.input_len}",
             ("input_len",)),
            (self.output_len is None or self.output_len >= 1, f"{{output_len}} must be >= 1, got {self.output_len}",
             ("output_len",)),
            (0 <= self.range_ratio < 1, f"{{range_ratio}} must be in [0, 1), got {self.range_ratio}", ("range_ratio",)),
            (self.request_rate > 0, f"{{request_rate}} must be > 0 (or inf), got {self.request_rate}",
             ("request_rate",)),
            (self.burstiness > 0, f"{{burstiness}} must be > 0, got {self.burstiness}", ("burstiness",)),
            (not (self.dataset == "sharegpt-like" and self.input_len is not None),
             "sharegpt-like draws prompt lengths from its own distribution; use {dataset} random for a fixed "
             "{input_len}", ("input_len", "dataset")),
            (not (self.dataset == "sharegpt-llama3" and self.input_len is not None),
             "sharegpt-llama3 draws prompt lengths from its own distribution; use {dataset} random for a fixed "
             "{input_len}", ("input_len", "dataset")),
            (self.dataset == "prefix-shared" or self.prefix_len is None and self.num_prefixes is None,
             "{prefix_len} and {num_prefixes} shape the prefix-shared dataset only", ("prefix_len", "num_prefixes")),
            (self.prefix_len is None or self.prefix_len >= 1, f"{{prefix_len}} must be >= 1, got {self.prefix_len}",
             ("prefix_len",)),
            (self.arrival_rng in ARRIVAL_RNGS,
             f"{{arrival_rng}} must be one of {', '.join(ARRIVAL_RNGS)}, got {self.arrival_rng!r}", ("arrival_rng",)),
            (self.arrival_rng == "servelab" or self.rate_schedule is None,
             "{arrival_rng} numpy-legacy draws a constant rate's gaps; a {rate_schedule} has its own",
             ("arrival_rng", "rate_schedule")),
            (self.eos_mean_output is None or self.dataset == "sharegpt-llama3" and self.output_len is None,
             "{eos_mean_output} cuts sharegpt-llama3's dataset lengths at EOS; it takes no fixed {output_len}",
             ("eos_mean_output", "dataset", "output_len")),
            (self.eos_mean_output is None or self.eos_mean_output >= 1,
             f"{{eos_mean_output}} must be >= 1, got {self.eos_mean_output}", ("eos_mean_output",)),
            (self.num_prefixes is None or self.num_prefixes >= 1,
             f"{{num_prefixes}} must be >= 1, got {self.num_prefixes}", ("num_prefixes",)),
            ((self.trace is None) == (self.trace_format is None), "{trace} and {trace_format} go together",
             ("trace", "trace_format")),
            (self.trace_format is None or self.trace_format in TRACE_FORMATS,
             f"{{trace_format}} must be one of {', '.join(TRACE_FORMATS)}, got {self.trace_format!r}",
             ("trace_format",)),
            (self.trace is not None or (self.time_scale == 1.0 and self.max_requests is None and self.sample is None),
             "{time_scale}, {max_requests} and {sample} shape a {trace}", ("time_scale", "max_requests", "sample",
                                                                          "trace")),
            (self.time_scale > 0, f"{{time_scale}} must be > 0, got {self.time_scale}", ("time_scale",)),
            (self.max_requests is None or self.max_requests >= 1,
             f"{{max_requests}} must be >= 1, got {self.max_requests}", ("max_requests",)),
            (self.sample is None or self.sample >= 1, f"{{sample}} must be >= 1, got {self.sample}", ("sample",)),
            (self.trace is None or self.rate_schedule is None, "a {trace} has its own arrivals; drop {rate_schedule}",
             ("trace", "rate_schedule")),
        ])

    @property
    def shares_prefixes(self) -> bool:
        return self.dataset == "prefix-shared"

    @property
    def effective_prefix_len(self) -> int:
        return self.prefix_len or DEFAULT_PREFIX_LEN

    @property
    def effective_num_prefixes(self) -> int:
        return self.num_prefixes or DEFAULT_NUM_PREFIXES


@dataclass(frozen=True)
class SampledRequest:
    arrival_time: float  # seconds after the first request
    prompt_len: int
    output_len: int
    # prefix-shared: which of the workload's prefixes the prompt starts with, and its length
    prefix_group: int | None = None
    prefix_len: int = 0
    # A mooncake trace's prompt: one id per 512 tokens (trace_formats.MOONCAKE_BLOCK_TOKENS), equal ids equal blocks (() otherwise)
    block_hash_ids: tuple[int, ...] = ()


def trace_workload(config: WorkloadConfig) -> list[SampledRequest]:
    try:
        records = read_trace(config.trace, config.trace_format)  # type: ignore[arg-type]  # checked: both set
    except TraceError as err:
        raise FieldError(f"{{trace}}: {err}", "trace") from None
    if config.sample is not None and config.sample < len(records):
        keep = np.random.default_rng(config.seed).choice(len(records), size=config.sample, replace=False)
        records = [records[i] for i in sorted(keep.tolist())]
    if config.max_requests is not None:
        records = records[:config.max_requests]
    start = records[0].arrival_time
    return [SampledRequest((r.arrival_time - start) * config.time_scale, r.prompt_len, r.output_len,
                           block_hash_ids=r.block_hash_ids) for r in records]


def block_hash_prompt(block_hash_ids: tuple[int, ...], prompt_len: int, block_tokens) -> list[int]:
    """A prompt whose i-th 512-token block is block_tokens(block_hash_ids[i]), cut to
    prompt_len: requests sharing leading hash ids share those blocks' token ids exactly."""
    ids: list[int] = []
    for h in block_hash_ids:
        ids.extend(block_tokens(h))
    return ids[:prompt_len]


def generate_workload(config: WorkloadConfig) -> list[SampledRequest]:
    """The workload's requests in arrival order. Lengths and arrivals come from independent streams
    of one seed, so changing the rate keeps every request's lengths."""
    if config.trace is not None:
        return trace_workload(config)
    length_seed, arrival_seed = np.random.SeedSequence(config.seed).spawn(2)
    if config.rate_schedule is not None:
        arrivals = parse_rate_schedule(config.rate_schedule).arrival_times(config.burstiness,
                                                                            np.random.default_rng(arrival_seed))
        if arrivals.size == 0:
            raise FieldError("{rate_schedule} brings no requests", "rate_schedule")
        prompt_lens, output_lens = sample_lengths(replace(config, num_prompts=int(arrivals.size)),
                                                  np.random.default_rng(length_seed))
        return [SampledRequest(t, p, o) for t, p, o in zip(arrivals.tolist(), prompt_lens.tolist(),
                                                            output_lens.tolist())]
    prompt_lens, output_lens = sample_lengths(config, np.random.default_rng(length_seed))
    if config.arrival_rng == "numpy-legacy":
        arrivals = sample_arrival_times(config.num_prompts, config.request_rate, config.burstiness,
                                        np.random.RandomState(config.seed))
    else:
        arrivals = sample_arrival_times(config.num_prompts, config.request_rate, config.burstiness,
                                        np.random.default_rng(arrival_seed))
    if config.shares_prefixes:
        prefix_len = config.effective_prefix_len
        # a stream of its own (the bench's token ids take the third): lengths and arrivals stay those of random
        groups = np.random.default_rng(np.random.SeedSequence(config.seed).spawn(4)[3]).integers(
            config.effective_num_prefixes, size=config.num_prompts)
        return [SampledRequest(float(t), prefix_len + int(p), int(o), int(g), prefix_len)
                for t, p, o, g in zip(arrivals, prompt_lens, output_lens, groups)]
    return [SampledRequest(float(t), int(p), int(o)) for t, p, o in zip(arrivals, prompt_lens, output_lens)]


def sample_lengths(config: WorkloadConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = config.num_prompts
    if config.dataset in ("random", "prefix-shared"):
        default_len = DEFAULT_SUFFIX_LEN if config.shares_prefixes else DEFAULT_INPUT_LEN
        prompt = _uniform_lengths(config.input_len or default_len, config.range_ratio, n, rng)
        output = _uniform_lengths(config.output_len or DEFAULT_OUTPUT_LEN, config.range_ratio, n, rng)
        return prompt, output
    if config.dataset == "sharegpt-llama3":
        prompt, output = sharegpt_llama3.lengths(n, rng)
        if config.eos_mean_output is not None:
            output = sharegpt_llama3.eos_cut(output, config.eos_mean_output, rng)
    else:
        prompt, output = _sharegpt_like_lengths(n, rng)
    if config.output_len is not None:  # vLLM's --sharegpt-output-len
        output = np.full(n, config.output_len, dtype=np.int64)
    return prompt, output


def _uniform_lengths(length: int, range_ratio: float, n: int, rng: np.random.Generator) -> np.ndarray:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def _sharegpt_like_lengths(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    def draw(batch: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.rint(rng.lognormal(SHAREGPT_PROMPT_MU, SHAREGPT_PROMPT_SIGMA, batch)).astype(np.int64),
                np.rint(rng.lognormal(SHAREGPT_OUTPUT_MU, SHAREGPT_OUTPUT_SIGMA, batch)).astype(np.int64))

    return sharegpt_llama3.filtered(n, draw)  # the same filter as vLLM's sampler


def sample_arrival_times(num_requests: int, request_rate: float, burstiness: float,
                         rng: np.random.Generator | np.random.RandomState) -> np.ndarray:
    """Arrival offsets in seconds: the first request at 0, then gamma-distributed gaps with mean
    1/request_rate and shape burstiness (vllm bench serve's arrival process)."""
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def describe(config: WorkloadConfig) -> str:
    if config.trace is not None:
        shaped = [f"time x{config.time_scale:g}"] if config.time_scale != 1 else []
        shaped += [f"{config.sample} sampled"] if config.sample else []
        shaped += [f"first {config.max_requests}"] if config.max_requests else []
        return f"{config.trace_format} trace {config.trace}" + (f" ({', '.join(shaped)})" if shaped else "")
    rate = "inf" if math.isinf(config.request_rate) else f"{config.request_rate:g}"
    if config.dataset == "random":
        lengths = f"input {config.input_len or DEFAULT_INPUT_LEN} / output {config.output_len or DEFAULT_OUTPUT_LEN}"
        if config.range_ratio:
            lengths += f" (±{config.range_ratio:.0%})"
    elif config.shares_prefixes:
        num = config.effective_num_prefixes
        lengths = (f"{num} shared prefix{'es' if num != 1 else ''} of {config.effective_prefix_len} + suffix "
                   f"{config.input_len or DEFAULT_SUFFIX_LEN} / output {config.output_len or DEFAULT_OUTPUT_LEN}")
        if config.range_ratio:
            lengths += f" (±{config.range_ratio:.0%})"
    else:
        lengths = f"{config.dataset} lengths" + (f", output {config.output_len}" if config.output_len else "")
        if config.eos_mean_output is not None:
            lengths += f", outputs ending at EOS (mean {config.eos_mean_output:g})"
    burst = "" if config.burstiness == 1 else f", burstiness {config.burstiness:g}"
    if config.arrival_rng != "servelab":
        burst += f", {config.arrival_rng} arrivals"
    if config.rate_schedule is not None:
        schedule = parse_rate_schedule(config.rate_schedule).describe()
        return f"requests arriving on {schedule}{burst}, {lengths}, seed {config.seed}"
    return f"{config.num_prompts} requests at {rate} req/s{burst}, {lengths}, seed {config.seed}"
