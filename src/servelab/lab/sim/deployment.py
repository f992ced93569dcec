"""A deployment: replicas (or prefill + decode instances) of tp GPUs each, the scheduler settings of
every instance, and whether the model and a minimal KV cache fit in a GPU's memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from servelab.config import SCHEDULE_POLICIES, SchedulerConfig, SpeculativeConfig
from servelab.errors import check_fields
from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import GPU_EFFICIENCY, Efficiency
from servelab.specs import (DTYPE_BYTES, GIB, KV_CACHE_DTYPES, QUANTIZATION_BYTES, DeviceSpec, ModelSpec,
                            activation_dtype, kv_dtype)

ROUTERS = ("round-robin", "least-loaded", "prefix")
# vLLM's defaults on a datacenter GPU: --gpu-memory-utilization 0.9, max_num_seqs 256 and a chunked-prefill
# token budget of 8192 for the OpenAI server.
GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# CUDA context, CUDA graphs and NCCL buffers: vLLM's startup log reports 0.5-2 GiB of such non-torch memory.
RUNTIME_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    device: DeviceSpec
    num_gpus: int
    tensor_parallel_size: int = 1
    schedule: str = "continuous"
    # Both 0: every instance prefills and decodes. Otherwise P prefill and D decode instances.
    num_prefill_instances: int = 0
    num_decode_instances: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    block_size: int = 16
    router: str = "round-robin"
    dtype: str = "bfloat16"
    efficiency: Efficiency = field(default=GPU_EFFICIENCY, repr=False)
    # A fixed KV pool per instance (the CPU profile's); None: whatever GPU memory is left.
    kv_cache_bytes: int | None = None
    # A measured KV handoff link (the CPU profile's): (latency s, bytes/s); None: the device's link.
    kv_transfer_link: tuple[float, float] | None = None
    # As the engine's --enable-prefix-caching (continuous schedule only). Only requests of a prefix-shared
    # workload take part: the others' prompts are lengths, with nothing to share.
    enable_prefix_caching: bool = True
    # Engine flags the cost model prices: CUDA graphs replay decode steps (no kernel launches); one
    # scheduling pass plans num_scheduler_steps decode steps (vLLM's multi-step scheduling).
    cuda_graphs: bool = True
    num_scheduler_steps: int = 1
    # False: prefills run in steps of their own while decodes wait (SchedulerConfig.mixed_batches).
    mixed_batches: bool = True
    # Weight-only quantized checkpoint (vLLM --quantization; QUANTIZATION_BYTES); None: weights in dtype.
    quantization: str | None = None
    # vLLM --kv-cache-dtype: "auto" keeps the activations' dtype, "fp8" halves a bf16 cache's bytes.
    kv_cache_dtype: str = "auto"
    # Disaggregated only: the client's first token comes from the decode instance, after the KV handoff
    # and its first step (vLLM's disaggregated-prefill proxy sends the prompt to the prefill instance with
    # max_tokens=1, then streams the whole answer from the decode instance).
    first_token_from_decode: bool = False
    # vLLM V0's asynchronous output processing (0.6.0 on, default on; --disable-async-output-proc): a step's
    # sampled tokens are turned into outputs while the next step runs and reach the client when it ends,
    # so tokens arrive one engine step later (at once when the engine has nothing more to run).
    async_output: bool = False
    # Speculative decoding (the engine's --speculative-config): each decode step of a request drafts
    # num_speculative_tokens tokens and verifies them in a step of 1 + K rows; each draft is accepted with
    # probability spec_acceptance_rate until the first rejection (the cost model's executor draws them), so
    # a step gives (1 - a^(K+1)) / (1 - a) tokens on average. Prompt lookup drafts on the CPU: free here.
    speculative: SpeculativeConfig | None = None
    spec_acceptance_rate: float | None = None

    def __post_init__(self) -> None:
        tp, m = self.tensor_parallel_size, self.model
        p, d = self.num_prefill_instances, self.num_decode_instances
        check_fields([
            (self.schedule in SCHEDULE_POLICIES, f"{{schedule}} must be one of {', '.join(SCHEDULE_POLICIES)}",
             ("schedule",)),
            (self.router in ROUTERS, f"{{router}} must be one of {', '.join(ROUTERS)}", ("router",)),
            (self.dtype in DTYPE_BYTES, f"{{dtype}} must be one of {', '.join(DTYPE_BYTES)}", ("dtype",)),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, f"{{kv_cache_dtype}} must be one of {', '.join(KV_CACHE_DTYPES)}",
             ("kv_cache_dtype",)),
            (self.quantization is None or self.quantization in QUANTIZATION_BYTES,
             f"{{quantization}} must be one of {', '.join(QUANTIZATION_BYTES)}", ("quantization",)),
            (not self.first_token_from_decode or p > 0, "{first_token_from_decode} needs {disaggregate}",
             ("first_token_from_decode", "disaggregate")),
            (tp >= 1 and self.num_gpus >= 1, "{tp} and {num_gpus} must be >= 1", ("tp", "num_gpus")),
            (self.num_gpus % tp == 0, f"{{num_gpus}} {self.num_gpus} is not a multiple of {{tp}} {tp}",
             ("num_gpus", "tp")),
            (m.num_attention_heads % tp == 0,
             f"{{tp}} {tp} does not divide {m.name}'s {m.num_attention_heads} attention heads", ("tp",)),
            (m.num_key_value_heads % tp == 0 or tp % m.num_key_value_heads == 0,
             f"{{tp}} {tp} neither divides nor is a multiple of {m.name}'s {m.num_key_value_heads} KV heads", ("tp",)),
            (tp <= self.device.gpus_per_node, f"{{tp}} {tp} spans more than one {self.device.id} node "
             f"({self.device.gpus_per_node} devices); tensor parallelism needs the intra-node link", ("tp",)),
            ((p == 0) == (d == 0), "{disaggregate} needs at least one prefill and one decode instance",
             ("disaggregate",)),
            (p == 0 or (p + d) * tp == self.num_gpus,
             f"{{disaggregate}} {p}:{d} with {{tp}} {tp} needs {(p + d) * tp} GPUs, not {{num_gpus}} {self.num_gpus}",
             ("disaggregate", "tp", "num_gpus")),
            (p == 0 or self.schedule == "continuous", "{disaggregate} runs continuous batching on each side",
             ("disaggregate", "schedule")),
            (self.num_scheduler_steps >= 1, "{num_scheduler_steps} must be >= 1", ("num_scheduler_steps",)),
            (self.speculative is None or self.spec_acceptance_rate is not None,
             "{speculative_config} needs {spec_acceptance_rate} (`servelab lab profile` measures it)",
             ("speculative_config", "spec_acceptance_rate")),
            (self.spec_acceptance_rate is None or 0 <= self.spec_acceptance_rate <= 1,
             "{spec_acceptance_rate} must be in [0, 1]", ("spec_acceptance_rate",)),
            (self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1 and self.block_size >= 1,
             "{max_num_seqs}, {max_num_batched_tokens} and {block_size} must be >= 1",
             ("max_num_seqs", "max_num_batched_tokens", "block_size")),
        ])

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill_instances > 0

    @property
    def num_instances(self) -> int:
        return self.num_gpus // self.tensor_parallel_size

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(policy=self.schedule, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               max_model_len=self.model.max_position_embeddings, mixed_batches=self.mixed_batches,
                               num_scheduler_steps=self.num_scheduler_steps)

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.device, self.efficiency, self.tensor_parallel_size, self.dtype,
                         self.cuda_graphs, self.num_scheduler_steps, self.quantization, self.kv_cache_dtype)

    @property
    def kv_dtype(self) -> str:
        return kv_dtype(self.dtype, self.kv_cache_dtype)

    def describe(self) -> str:
        if self.disaggregated:
            shape = f"{self.num_prefill_instances} prefill + {self.num_decode_instances} decode instances"
        else:
            shape = f"{self.num_instances} replica{'s' if self.num_instances > 1 else ''}"
        return (f"{self.model.name} on {self.num_gpus}x {self.device.name}, TP {self.tensor_parallel_size}, "
                f"{shape}, {self.schedule} batching")

    def to_json(self) -> dict:
        return {
            "model": self.model.id, "gpu": self.device.id, "num_gpus": self.num_gpus,
            "tp": self.tensor_parallel_size, "schedule": self.schedule,
            "disaggregate": (f"{self.num_prefill_instances}:{self.num_decode_instances}" if self.disaggregated else None),
            "num_instances": self.num_instances, "router": self.router, "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens, "block_size": self.block_size, "dtype": self.dtype,
            **({} if self.enable_prefix_caching else {"enable_prefix_caching": False}),
            "cuda_graphs": self.cuda_graphs, "num_scheduler_steps": self.num_scheduler_steps,
            **({} if self.mixed_batches else {"mixed_batches": False}),
            **({"quantization": self.quantization} if self.quantization else {}),
            **({"kv_cache_dtype": self.kv_cache_dtype} if self.kv_cache_dtype != "auto" else {}),
            **({"first_token_from_decode": True} if self.first_token_from_decode else {}),
            **({"async_output": True} if self.async_output else {}),
            **({"speculative_config": {"method": self.speculative.method,
                                       "num_speculative_tokens": self.speculative.num_speculative_tokens},
                "spec_acceptance_rate": self.spec_acceptance_rate} if self.speculative else {}),
        }


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU of one instance."""
    memory_bytes: int
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    num_blocks: int
    max_request_tokens: int
    fits: bool
    reason: str

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def plan_memory(d: Deployment, max_request_tokens: int) -> MemoryPlan:
    m, tp = d.model, d.tensor_parallel_size
    weights = m.weight_bytes(d.dtype, d.quantization) // tp  # vocab-parallel embeddings shard too
    kv_per_token = m.kv_bytes_per_token(d.kv_dtype, tp)
    if d.kv_cache_bytes is not None:
        usable, activations, kv = d.device.memory_bytes, 0, d.kv_cache_bytes
        if weights + kv > usable:
            kv = 0
    else:
        usable = int(d.device.memory_bytes * GPU_MEMORY_UTILIZATION)
        # vLLM's profiling run: one forward of max_num_batched_tokens (MLP activations dominate) plus fp32 logits.
        activations = (m.forward_activation_bytes(d.max_num_batched_tokens, d.max_num_seqs, activation_dtype(d.dtype), tp)
                       + RUNTIME_RESERVE_BYTES)
        kv = max(0, usable - weights - activations)
    num_blocks = kv // (kv_per_token * d.block_size)
    need_blocks = -(-max_request_tokens // d.block_size)
    reason = ""
    if kv <= 0:
        reason = (f"weights need {weights / GIB:.1f} GiB per GPU (TP {tp}) and activations {activations / GIB:.1f} GiB, "
                  f"but a {d.device.name} offers {usable / GIB:.1f} GiB: no room for the KV cache")
    elif num_blocks < need_blocks:
        reason = (f"after {weights / GIB:.1f} GiB of weights per GPU, the KV cache gets {kv / GIB:.2f} GiB = "
                  f"{num_blocks * d.block_size:,} tokens, fewer than the workload's largest request "
                  f"({max_request_tokens:,} tokens)")
    return MemoryPlan(memory_bytes=d.device.memory_bytes, usable_bytes=usable, weight_bytes=weights,
                      activation_bytes=activations, kv_cache_bytes=kv, kv_bytes_per_token=kv_per_token,
                      num_blocks=num_blocks, max_request_tokens=max_request_tokens, fits=not reason, reason=reason)
