"""Torch-free specs: a model's shape from its config.json (parameters, weight bytes, KV bytes per token,
FLOPs per token, MoE active vs total) and a device's peak figures. The real engine, the cost model, the
profiler and calibration all read these; nothing else parses config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
# fp8 and fp4 are checkpoints whose decoder GEMMs run in that precision (vLLM's fp8 W8A8; NVFP4, 4-bit values
# with an fp8 scale per 16, so 4.5 bits). Their activations, embeddings and LM head stay bfloat16, and so
# does their KV cache unless the KV cache is quantized on its own (--kv-cache-dtype fp8).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp4": 4.5 / 8}
LOW_PRECISION = ("fp8", "fp4")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# servelab's --kv-cache-dtype int8 (model/attention.py quantize_kv): each K or V row of head_dim int8 values is
# followed by its fp32 scale
INT8_KV_SCALE_BYTES = 4


def activation_dtype(dtype: str) -> str:
    """The dtype between the GEMMs: bfloat16 for a low-precision checkpoint, else the dtype."""
    return "bfloat16" if dtype in LOW_PRECISION else dtype


def precision(dtype: str, quantization: str | None = None) -> str:
    """The GEMMs' precision class an answer's error band is looked up by: bf16 (any 16/32-bit dtype), fp8,
    fp4, or the weight-only quantization's name."""
    if quantization:
        return quantization
    return dtype if dtype in LOW_PRECISION else "bf16"


def kv_dtype(dtype: str, kv_cache_dtype: str = "auto") -> str:
    """The KV cache's dtype: vLLM's --kv-cache-dtype auto keeps the activations' dtype."""
    return kv_cache_dtype if kv_cache_dtype in ("fp8", "int8") else activation_dtype(dtype)
# Weight-only quantized checkpoints (vLLM --quantization): bytes per decoder matmul weight, with the group
# scales and zero points. GPTQ int4, group size 128: 4 bits, plus an fp16 scale and a 4-bit zero per 128.
# Embeddings, LM head, norms, activations and the KV cache keep the dtype.
QUANTIZATION_BYTES = {"gptq-int4": (4 + (16 + 4) / 128) / 8}


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
    # Streaming multiprocessors (NVIDIA) or compute units (AMD): how many GEMM tiles run at once, so how many
    # rows a step needs to fill the chip. None: a measured CPU profile (its curves are measured as they are).
    compute_units: int | None = None
    # Architecture family (hopper, blackwell, ampere, ada, cdna3): a GPU without fitted constants of its own
    # takes its family's. Dense tensor FLOP/s at fp8 and fp4 where the chip has such units (None: it has
    # not, and a checkpoint in that precision dequantizes to bf16 in its GEMMs).
    family: str = ""
    fp8_flops: float | None = None
    fp4_flops: float | None = None
    # The share of memory_bandwidth a STREAM-like copy measures: no kernel streams faster. None: a measured
    # CPU profile, whose fractions are conversion factors of its own fitted figures.
    memory_ceiling: float | None = None

    def gemm_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s of a GEMM whose operands are in dtype."""
        rate = {"fp8": self.fp8_flops, "fp4": self.fp4_flops}.get(dtype)
        return rate or self.flops

    @property
    def interconnect_bandwidth_per_direction(self) -> float:
        return self.interconnect_bandwidth / 2


# config.json files that name a model_type but no architectures
_MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}


def hf_architecture(cfg: dict) -> str:
    """The architecture a Hugging Face config.json names: its first `architectures` entry, else the one
    its `model_type` stands for."""
    archs = cfg.get("architectures") or []
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    if not model_type:
        raise ValueError("config.json names no architecture (neither 'architectures' nor 'model_type')")
    return _MODEL_TYPE_ARCHITECTURES.get(model_type, model_type)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape, read from its config.json: what the real engine builds and
    what the lab prices. Which architectures the engine can run is the loader's business, not this."""
    id: str
    name: str
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
    num_experts: int = 1  # 1 for a dense model
    num_experts_per_tok: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.name}: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok must be in 1..{self.num_experts}")

    @classmethod
    def from_hf_config(cls, cfg: dict, id: str, name: str | None = None, source: str = "") -> "ModelSpec":
        try:
            arch = hf_architecture(cfg)
            heads = cfg["num_attention_heads"]
            eos = cfg.get("eos_token_id")
            scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            theta = cfg.get("rope_theta")
            if theta is None and isinstance(cfg.get("rope_parameters"), dict):
                theta = cfg["rope_parameters"].get("rope_theta")
            return cls(
                id=id, name=name or id, architecture=arch, vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta if theta is not None else 10000.0),
                rope_scaling=(tuple(sorted((k, v) for k, v in scaling.items() if k != "rope_theta"))
                              if scaling else None),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
                num_experts=cfg.get("num_local_experts") or 1,
                num_experts_per_tok=cfg.get("num_experts_per_tok") or 1,
                source=source,
            )
        except KeyError as missing:
            raise ValueError(f"model config {id!r} lacks the field {missing.args[0]!r}") from None
        except ValueError as err:
            raise ValueError(f"model config {id!r}: {err}") from None

    # ---- parameters (weights of one copy of the model)
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

    @property
    def dense_params_per_layer(self) -> int:
        """Matmul weights of a layer that every token uses (all but the experts)."""
        return self.attention_params_per_layer + self.router_params_per_layer

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _params(self, experts_per_layer: int) -> int:
        h = self.hidden_size
        per_layer = (self.attention_params_per_layer + experts_per_layer * self.expert_params
                     + self.router_params_per_layer + 2 * h)
        embed = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    @property
    def num_params(self) -> int:
        return self._params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: a MoE's num_experts_per_tok experts per layer, not all of them."""
        return self._params(self.num_experts_per_tok)

    def weight_bytes(self, dtype: str, quantization: str | None = None) -> int:
        """Decoder matmul weights quantized (or in a low-precision dtype); embeddings, LM head and norms in
        the activations' dtype."""
        if quantization is None and dtype not in LOW_PRECISION:
            return self.num_params * DTYPE_BYTES[dtype]
        per_weight = QUANTIZATION_BYTES[quantization] if quantization else DTYPE_BYTES[dtype]
        quantized = self.num_hidden_layers * (self.attention_params_per_layer + self.num_experts * self.expert_params)
        rest = DTYPE_BYTES[activation_dtype(dtype)]
        return int(quantized * per_weight + (self.num_params - quantized) * rest)

    # ---- KV cache, per token and per tensor-parallel rank
    def num_kv_heads_per_rank(self, tensor_parallel_size: int = 1) -> int:
        """KV heads split across ranks; replicated (one per rank) when tp exceeds them, as vLLM does."""
        tp, kv_heads = tensor_parallel_size, self.num_key_value_heads
        if tp < 1 or (kv_heads % tp and tp % kv_heads):
            raise ValueError(f"tensor parallel size {tp} neither divides nor is a multiple of {self.name}'s "
                             f"{kv_heads} KV heads")
        return max(1, kv_heads // tp)

    def layer_kv_bytes_per_token(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        """dtype: a KV cache dtype (kv_dtype()); int8 rows carry their scale."""
        row = self.head_dim + INT8_KV_SCALE_BYTES if dtype == "int8" else self.head_dim * DTYPE_BYTES[dtype]
        return 2 * self.num_kv_heads_per_rank(tensor_parallel_size) * row  # K and V

    def kv_bytes_per_token(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        return self.num_hidden_layers * self.layer_kv_bytes_per_token(dtype, tensor_parallel_size)

    # ---- FLOPs and activations
    @property
    def decoder_matmul_params(self) -> int:
        """Matmul weights of all decoder layers that one token multiplies by (k experts of a MoE)."""
        return self.num_hidden_layers * (
            self.attention_params_per_layer + self.num_experts_per_tok * self.expert_params
            + self.router_params_per_layer)

    @property
    def flops_per_token(self) -> int:
        """Matmul FLOPs of one token's forward pass, context-free (attention scores add
        num_hidden_layers * layer_score_flops_per_pair() per token of context)."""
        return 2 * (self.decoder_matmul_params + self.lm_head_params)

    def layer_score_flops_per_pair(self, tensor_parallel_size: int = 1) -> int:
        """FLOPs of one (query, key) pair in one layer on one rank: QK^T and PV over its heads."""
        tp = tensor_parallel_size
        if tp < 1 or self.num_attention_heads % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {self.name}'s "
                             f"{self.num_attention_heads} attention heads")
        return 4 * (self.num_attention_heads // tp) * self.head_dim

    def hidden_bytes_per_token(self, dtype: str) -> int:
        """One token's hidden state: what a tensor-parallel all-reduce moves per token."""
        return self.hidden_size * DTYPE_BYTES[dtype]

    def layer_elementwise_bytes_per_token(self, dtype: str, tensor_parallel_size: int = 1) -> int:
        """HBM bytes one token's activations move through a decoder layer's non-GEMM kernels on one rank:
        two fused residual-add + RMS norms (each reads the hidden state and the residual and writes both,
        on every rank after the all-reduce), rotary embedding in place on q and k, and the gated
        activation (reads gate and up, writes their product; k experts' of a MoE). GEMMs and attention
        count their own operands; these kernels run between them and stream the step's rows once each."""
        tp = tensor_parallel_size
        h, rotary = self.hidden_size, 2 * (self.q_size + self.kv_size) // tp
        gated = 3 * self.num_experts_per_tok * self.intermediate_size // tp
        return (8 * h + rotary + gated) * DTYPE_BYTES[dtype]

    def forward_activation_bytes(self, num_tokens: int, num_logit_rows: int, dtype: str,
                                 tensor_parallel_size: int = 1) -> int:
        """Peak activations of one forward pass on one rank: num_tokens rows through the MLP (which
        dominates) plus fp32 logits for num_logit_rows."""
        tp = tensor_parallel_size
        return (num_tokens * (2 * self.intermediate_size // tp + 4 * self.hidden_size) * DTYPE_BYTES[dtype]
                + num_logit_rows * (self.vocab_size // tp) * 4)
