"""What a serving engine reaches of a device's peak (Efficiency), its CPU-side overheads, and the all-reduce fits
of measured machines: the constants the cost model (executor/cost_model.py) prices a step with."""
from __future__ import annotations

from dataclasses import dataclass

from servelab.executor.curve import PiecewiseLinear
from servelab.specs import DeviceSpec

# vLLM captures CUDA graphs for decode batches up to this size; larger batches and prefills run eagerly.
CUDA_GRAPH_MAX_BATCH_SIZE = 256


@dataclass(frozen=True)
class AllReduceFit:
    """One all-reduce between world_size processes on a measured machine: latency_s + bytes / bytes_per_s
    (`servelab lab profile`, gloo over the loopback); samples are the (bytes, seconds) it was fitted to."""
    world_size: int
    latency_s: float
    bytes_per_s: float
    samples: tuple[tuple[int, float], ...] = ()

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Efficiency:
    """Fractions of a device's peak a serving engine reaches, and its CPU-side overheads. Bounds of the
    fitted GPU constants: servelab.lab.catalog.calibration.BOUNDS."""
    matmul: float  # GEMM efficiency reached at large token counts
    attention: float
    memory: float
    kv_memory: float
    interconnect: float  # share of the link's bandwidth a ring all-reduce reaches
    allreduce_latency_s: float  # alpha: fixed cost of one all-reduce call on the link
    step_overhead_s: float
    request_overhead_s: float
    token_overhead_s: float = 0.0  # input preparation and sampling bookkeeping per scheduled token
    # Token count at which GEMMs (attention kernels) reach half their large-shape efficiency; 0: flat.
    matmul_half_tokens: float = 0.0
    attention_half_tokens: float = 0.0
    # Launch cost of one layer's kernels, paid by every step that no CUDA graph replays.
    layer_launch_overhead_s: float = 0.0
    # API server per request, off the GPU's path: HTTP, tokenization and the first chunk before the first
    # token; detokenization and the closing chunk after the last.
    api_ttft_overhead_s: float = 0.0
    api_final_overhead_s: float = 0.0
    # Measured instead of max(FLOPs, bytes) (a CPU profile, tp 1 only): seconds of all decoder layers'
    # linear layers against the step's token count, and of the LM head against the rows it samples.
    layers_curve: PiecewiseLinear | None = None
    lm_head_curve: PiecewiseLinear | None = None
    # Measured serving overhead per step against the requests in it (a CPU profile), on top of the above.
    overhead_curve: PiecewiseLinear | None = None
    # Measured cost of taking a request in (a CPU profile): HTTP parsing, tokenization and admission run
    # on the cores the model uses, so the step that starts a new request's prefill pays for them.
    arrival_overhead_s: float = 0.0
    # Measured all-reduces (a CPU profile), one per world size: tensor parallelism over processes that
    # share the profiled machine's cores.
    all_reduce: tuple[AllReduceFit, ...] = ()

    def all_reduce_fit(self, world_size: int) -> AllReduceFit | None:
        return next((f for f in self.all_reduce if f.world_size == world_size), None)


# Datacenter GPUs running vLLM-class kernels, before calibration (servelab.lab.catalog.calibration fits
# these to published measurements; these priors are where the fit starts). Each anchored to a public figure:
GPU_EFFICIENCY = Efficiency(
    # cuBLAS bf16 GEMMs at LLM shapes reach ~70% of dense peak on A100/H100 (NVIDIA's Megatron-LM and
    # cuBLAS benchmark posts report 60-75%).
    matmul=0.70,
    # FlashAttention-2 reaches 50-73% of peak on A100 and ~35-50% on H100 (Dao 2023, FlashAttention-2 paper).
    attention=0.50,
    # Weight-streaming GEMV kernels read at ~80% of HBM peak (STREAM-like copies reach 85-90%).
    memory=0.80,
    # Paged KV reads are scattered over blocks: ~70% of HBM peak (vLLM PagedAttention paper, fig. on kernel overhead).
    kv_memory=0.70,
    # NCCL ring all-reduce bus bandwidth ~70-80% of NVLink peak in nccl-tests.
    interconnect=0.75,
    # nccl-tests all_reduce_perf on 8 NVLink GPUs: 10-20 us for small messages.
    allreduce_latency_s=10e-6,
    # vLLM V1 with CUDA graphs: scheduling, input preparation and sampling take a few hundred microseconds
    # per step plus microseconds per request (vLLM V1 design blog, 2025).
    step_overhead_s=300e-6,
    request_overhead_s=3e-6,
    # GEMMs with few rows are latency- and tile-bound: cuBLAS reaches half its peak share near 64-256 rows.
    matmul_half_tokens=128.0,
    attention_half_tokens=128.0,
    # ~12 kernels per decoder layer at ~4 us of launch each (CUDA launch latency, PyTorch eager).
    layer_launch_overhead_s=50e-6,
)


# Serving stacks by version (`lab simulate --engine`), each with its CPU-side overheads before calibration:
# where GPU_EFFICIENCY's few hundred microseconds a step do not describe the stack, its own priors, from
# the stack's published design and profiles. The fit (servelab lab calibrate) moves them; a stack with no
# reference point prices with its priors.
ENGINE_SOURCES = {
    "vllm": "vLLM V1 (the default engine since 0.8): the scheduler and input preparation in an EngineCore "
            "process busy-looping beside the API server, a persistent batch that applies only each step's "
            "changes to the input tensors, piecewise CUDA graphs (vLLM blog 'vLLM V1: A Major Upgrade to "
            "vLLM's Core Architecture', 2025-01-27; RFC #8779): a few hundred microseconds a step",
    "vllm-v0": "vLLM V0 (0.6.x, 0.7.x): scheduling, input preparation, sampling metadata and output processing "
               "between two steps, growing with the batch: '5-13 ms of GPU bubble' a decode step, ~4 ms in "
               "traces (RFC #6854, multi-step scheduling, 2024-07) and 'when BS is 200, all this together can be "
               "20 ms' (RFC #6801, 2024-08-08): ~4 ms a pass plus (20 - 4) ms / 200 = 80 us a request",
    "sglang": "SGLang >= 0.4: the zero-overhead batch scheduler runs the next batch's CPU work while the GPU "
              "runs this one, leaving no GPU idle between batches in its Nsight profiles (LMSYS blog 'SGLang "
              "v0.4', 2024-12-04); earlier versions' points are priced with the same key",
    "tensorrt-llm": "TensorRT-LLM 1.x with its PyTorch backend: a C++ batch manager and the overlap scheduler, "
                    "which prepares step n+1 while step n runs (TensorRT-LLM docs, 'Overlap Scheduler'); NeMo's "
                    "published runs of the TensorRT runtime are priced with the same key",
    "lmdeploy": "LMDeploy's TurboMind: a C++/CUDA engine with persistent batching and no Python in the step "
                "loop (LMDeploy docs, 'TurboMind architecture')",
}
ENGINE_PRIORS: dict[str, dict[str, float]] = {
    "vllm": {"step_overhead_s": 400e-6, "request_overhead_s": 5e-6},
    "vllm-v0": {"step_overhead_s": 4e-3, "request_overhead_s": 80e-6},
    "sglang": {"step_overhead_s": 200e-6, "request_overhead_s": 2e-6},
    "tensorrt-llm": {"step_overhead_s": 300e-6, "request_overhead_s": 3e-6},
    "lmdeploy": {"step_overhead_s": 200e-6, "request_overhead_s": 2e-6},
}
ENGINES = tuple(ENGINE_SOURCES)


# The GPU matmul_half_tokens is stated for: an H100 SXM's 132 SMs.
REFERENCE_COMPUTE_UNITS = 132


def matmul_half_tokens(efficiency: Efficiency, device: DeviceSpec) -> float:
    """Rows at which a GEMM reaches half its peak share on `device`. A step's GEMMs split into output tiles
    (ceil(M / tile rows) x ceil(N / tile columns)) that run one per SM (NVIDIA) or CU (AMD) at a time, so at a
    given N the rows that fill the chip grow with its SMs/CUs: an A10's 72 SMs fill at about half the rows of
    an H100's 132, an MI300X's 304 CUs at about 2.3 times. The constant itself is fitted per GPU (stated for
    132 SMs): how soon a GEMM hides its weight stream behind the math is also the chip's pipeline (Hopper's TMA
    and warp-specialised wgmma against Ampere's cp.async stages). A measured CPU profile (no compute_units)
    keeps the constant as fitted."""
    units = device.compute_units
    return efficiency.matmul_half_tokens * (units / REFERENCE_COMPUTE_UNITS if units else 1.0)
