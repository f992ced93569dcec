"""Frozen configuration dataclasses. Validation only: no I/O, no torch. The model's shape is a
servelab.specs.ModelSpec, shared with the lab."""
from __future__ import annotations

from dataclasses import dataclass, field

from servelab.specs import ModelSpec

SCHEDULE_POLICIES = ("serial", "static", "continuous")
QUANTIZATION_METHODS = ("gguf", "int8")  # model/quant/quantization.py
# --quantization: auto (the default) picks per model and machine (model/quant/auto_quantization.py); none = float weights.
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
# vLLM's --kv-cache-dtype: "auto" stores K and V in the model's dtype; "int8" one byte per value with an fp32
# scale per (token, KV head) row (model/attention.py quantize_kv), half of bf16's bytes.
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # GiB when >= 1, a fraction of the machine's memory when in (0, 1).
    kv_cache_memory: float = 2.0
    # Overrides kv_cache_memory when set (tests use tiny pools to force preemption).
    num_blocks: int | None = None
    # Share the KV of full blocks between requests with the same prefix (paged stages only).
    enable_prefix_caching: bool = True
    # KV_CACHE_DTYPES (vLLM's CacheConfig.cache_dtype).
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 (GiB, or a fraction in (0, 1)), got {self.kv_cache_memory}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "continuous"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048
    # Continuous batching only. True: a step carries prefill chunks beside the decodes (vLLM's chunked
    # prefill, V1's only mode). False: waiting prompts get a step of their own while the running requests'
    # decodes wait (vLLM V0 without --enable-chunked-prefill, as multi-step scheduling required in 0.6.0;
    # SGLang without --enable-mixed-chunk); a prompt is split only when it alone exceeds the budget.
    mixed_batches: bool = True
    # Without mixed batches: one scheduling pass plans this many decode steps (vLLM V0's multi-step
    # scheduling), so waiting prompts are admitted only between passes.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.policy!r}")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {self.num_scheduler_steps}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def effective_max_num_seqs(self) -> int:
        return 1 if self.policy == "serial" else self.max_num_seqs

    @property
    def contiguous(self) -> bool:
        """Stages 1 and 2 reserve prompt + max_tokens up front instead of paging on demand."""
        return self.policy in ("serial", "static")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: method "ngram" is prompt lookup. Each decode step of a greedy request
    proposes up to num_speculative_tokens tokens: those that followed the longest n-gram (prompt_lookup_min
    to prompt_lookup_max tokens) that ends the request's tokens and also occurs earlier in its prompt or
    output. The step verifies them and keeps the ones the model agrees with.

    draft_min_acceptance (servelab's, not vLLM's) makes the draft length adaptive per request: draft position i
    is proposed only while the request's estimated chance that a draft is accepted up to position i (a moving
    average over its recent drafts, core/spec_decode/ngram.py) is at least this, so a request whose drafts miss
    stops paying for verify rows, and starts again when its lookups would hit. 0: always up to
    num_speculative_tokens, as vLLM."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    draft_min_acceptance: float = 0.5

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not 0 <= self.draft_min_acceptance <= 1:
            raise ValueError(f"draft_min_acceptance must be within 0 and 1, got {self.draft_min_acceptance}")

    @classmethod
    def from_json(cls, text: str) -> "SpeculativeConfig":
        """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'"""
        import json

        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config takes a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 3}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_min_acceptance"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--speculative-config has unknown keys {unknown}; it takes {sorted(known)}")
        rate = values.get("draft_min_acceptance", 0)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool):
            raise ValueError(f"--speculative-config draft_min_acceptance must be a number, got {rate!r}")
        for key in known - {"method", "draft_min_acceptance"}:
            if key in values and (not isinstance(values[key], int) or isinstance(values[key], bool)):
                raise ValueError(f"--speculative-config {key} must be an integer, got {values[key]!r}")
        if "num_speculative_tokens" not in values:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        # vLLM's defaults: 5 and 5 when neither is given, else the one given for both
        values.setdefault("prompt_lookup_max", values.get("prompt_lookup_min", 5))
        values.setdefault("prompt_lookup_min", values["prompt_lookup_max"])
        return cls(**values)


def tensor_parallel_problem(model: ModelSpec, size: int) -> str | None:
    """Why `size` ranks cannot split this model evenly, or None when they can. Each rank takes
    1/size of the attention heads and MLP columns, and 1/size of the KV heads or, when size exceeds
    them, one whole KV head copied on size / num_key_value_heads ranks (vLLM's rule)."""
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads % size:
        return f"it does not divide the model's {heads} attention heads"
    if kv_heads % size and size % kv_heads:
        return f"it neither divides the model's {kv_heads} KV heads nor is a multiple of them"
    if model.intermediate_size % size:
        return f"it does not divide the model's MLP width {model.intermediate_size}"
    return None


def valid_tensor_parallel_sizes(model: ModelSpec) -> list[int]:
    return [n for n in range(1, model.num_attention_heads + 1) if tensor_parallel_problem(model, n) is None]


@dataclass(frozen=True)
class ParallelConfig:
    """tensor_parallel_size ranks spread evenly over nnodes machines (vLLM's multi-node flags): node n runs
    ranks n * ranks_per_node ... (n + 1) * ranks_per_node - 1. Every rank joins torch.distributed's
    rendezvous store at master_addr:master_port, which node 0 (the one with the engine core) hosts;
    master_port None lets the OS pick a port, which only works when every rank is on node 0."""
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in 0 .. nnodes - 1 = {self.nnodes - 1}, got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} cannot be spread evenly over "
                             f"{self.nnodes} nodes: it must be a multiple of nnodes")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1 .. 65535, got {self.master_port}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("master_port is required with nnodes > 1: every node must know where node 0's "
                             "rendezvous store listens")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The tensor-parallel ranks that run on this node."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    def verify_with_model(self, model: ModelSpec) -> None:
        problem = tensor_parallel_problem(model, self.tensor_parallel_size)
        if problem is not None:
            valid = ", ".join(map(str, valid_tensor_parallel_sizes(model)))
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} cannot shard this model: {problem}; "
                             f"valid sizes for it: {valid}")


KV_ROLES = ("kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """One instance's place in a disaggregated prefill/decode deployment (vLLM's kv_transfer_config):
    kv_producer instances prefill and send KV blocks, kv_consumer instances receive them and decode.
    Every instance is one rank (kv_rank) of a torch.distributed group of kv_parallel_size, joined
    through the store at kv_ip:kv_port."""
    kv_role: str
    kv_rank: int
    kv_parallel_size: int
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not 0 <= self.kv_rank < self.kv_parallel_size:
            raise ValueError(f"kv_rank {self.kv_rank} outside a group of {self.kv_parallel_size}")


def parse_disaggregate(value: str) -> tuple[int, int]:
    """'P:D' -> (P prefill instances, D decode instances), as the lab's --disaggregate flag reads it."""
    prefill, sep, decode = value.partition(":")
    if not sep or not prefill.isdigit() or not decode.isdigit() or int(prefill) < 1 or int(decode) < 1:
        raise ValueError(f"--disaggregate takes P:D with P, D >= 1 (e.g. 1:1), got {value!r}")
    return int(prefill), int(decode)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSpec
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"
    kv_transfer: KVTransferConfig | None = None
    speculative: SpeculativeConfig | None = None
    # QUANTIZATION_METHODS, or None for float weights: --quantization as resolved (never "auto")
    quantization: str | None = None

    def __post_init__(self) -> None:
        self.parallel.verify_with_model(self.model)
        if self.kv_transfer is not None and self.parallel.tensor_parallel_size > 1:
            raise ValueError("disaggregated prefill/decode runs each instance on one rank: it cannot be combined "
                             "with tensor_parallel_size > 1")
