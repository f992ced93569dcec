"""Torch-free specs: a model's shape from its config.json (parameters, weight bytes, KV bytes per token,
FLOPs per token, MoE active vs total) and a device's peak figures. The real engine, the cost model, the
profiler and calibration all read these; nothing else parses config.json."""
from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class DeviceSpec:
    id: str
    name: str
    flops: float  # dense bf16 FLOP/s (peak for a GPU, fitted effective value for a CPU profile)
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    interconnect: str
    interconnect_bandwidth: float  # bytes/s, both directions together, as datasheets quote it
    network_bandwidth: float  # bytes/s per device, between nodes
    gpus_per_node: int
    source: str

    @property
    def interconnect_bandwidth_per_direction(self) -> float:
        return self.interconnect_bandwidth / 2


@dataclass(frozen=True)
class ModelSpec:
    id: str
    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int  # 1 for a dense model
    num_experts_per_tok: int
    source: str

    @classmethod
    def from_hf_config(cls, cfg: dict, id: str, name: str | None = None, source: str = "") -> "ModelSpec":
        try:
            heads = cfg["num_attention_heads"]
            arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
            return cls(
                id=id, name=name or id, architecture=arch,
                hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                num_experts=cfg.get("num_local_experts") or 1,
                num_experts_per_tok=cfg.get("num_experts_per_tok") or 1,
                source=source,
            )
        except KeyError as missing:
            raise ValueError(f"model config {id!r} lacks the field {missing.args[0]!r}") from None

    # ---- derived sizes
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        return h * (q + 2 * kv) + q * h + (q + 2 * kv if self.attention_bias else 0)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size  # gate, up, down

    @property
    def router_params_per_layer(self) -> int:
        return self.hidden_size * self.num_experts if self.num_experts > 1 else 0

    def _params(self, experts_per_layer: int) -> int:
        h = self.hidden_size
        per_layer = (self.attention_params_per_layer + experts_per_layer * self.expert_params
                     + self.router_params_per_layer + 2 * h)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    @property
    def num_params(self) -> int:
        return self._params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        return self._params(self.num_experts_per_tok)

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * DTYPE_BYTES[dtype]

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token's forward pass, context-free (attention scores add
        4 * num_hidden_layers * q_size per token of context)."""
        matmul_params = self.num_hidden_layers * (
            self.attention_params_per_layer + self.num_experts_per_tok * self.expert_params + self.router_params_per_layer)
        return 2 * (matmul_params + self.vocab_size * self.hidden_size)
