"""Frozen configuration dataclasses. Validation only: no I/O, no torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SCHEDULE_POLICIES = ("serial", "static", "continuous")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def _check_architecture(arch: str) -> None:
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported model architecture {arch!r}; servelab runs {', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3-style scaling as a sorted tuple of (key, value) so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_architecture(self.architecture)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                       "qwen2": "Qwen2ForCausalLM"}.get(cfg.get("model_type", ""), "")
        if not arch:
            raise ValueError("config.json names no architecture (neither 'architectures' nor a known 'model_type')")
        _check_architecture(arch)  # before reading fields, so an unsupported model says so instead of a KeyError
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(cfg.get("rope_parameters"), dict):
            theta = cfg["rope_parameters"].get("rope_theta")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_theta")) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def num_params(self) -> int:
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.attention_bias:
            per_layer += q + 2 * kv
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # GiB when >= 1, a fraction of the machine's memory when in (0, 1).
    kv_cache_memory: float = 2.0
    # Overrides kv_cache_memory when set (tests use tiny pools to force preemption).
    num_blocks: int | None = None

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.policy!r}")
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


def tensor_parallel_problem(model: ModelConfig, size: int) -> str | None:
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


def valid_tensor_parallel_sizes(model: ModelConfig) -> list[int]:
    return [n for n in range(1, model.num_attention_heads + 1) if tensor_parallel_problem(model, n) is None]


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")

    def verify_with_model(self, model: ModelConfig) -> None:
        problem = tensor_parallel_problem(model, self.tensor_parallel_size)
        if problem is not None:
            valid = ", ".join(map(str, valid_tensor_parallel_sizes(model)))
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} cannot shard this model: {problem}; "
                             f"valid sizes for it: {valid}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        self.parallel.verify_with_model(self.model)
