"""`--quantization auto`, the default: which weights and KV cache a model runs with on this machine, and why.

The order (the first rule that applies decides):
1. an explicit --quantization (none, gguf, int8) wins;
2. an explicit --dtype asks for float weights in that dtype;
3. a Hugging Face folder keeps its float weights unless the user asks otherwise, as vLLM does;
4. without servelab's CPU kernels (not built, or SERVELAB_NO_KERNELS=1) the quantized paths are slow: float weights;
5. the default model: MEASURED_FASTEST, the fastest mode measured that stays within the perplexity gate
   (3% of bf16 at ctx 512 and 256; docs/precision.md has the table and the commands);
6. any other .gguf file: float weights, since no mode has been measured against the gate for it.
Rules 2-6 keep an explicit --kv-cache-dtype int8; --kv-cache-dtype auto then means the model's dtype, except under
rule 6, which picks the KV cache dtype measured with the weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.engine_args import EngineArgs

# (quantization, kv_cache_dtype) the default model runs by default. The 64-request burst (128 in, 64 out) served
# next to llama.cpp's best configuration: 540 tok/s against 209 for bf16 weights and cache; perplexity
# -1.92% (ctx 512) and +1.67% (ctx 256) against bf16; gguf blocks measured slower in batched steps.
MEASURED_FASTEST = ("int8", "int8")


@dataclass(frozen=True)
class QuantizationChoice:
    quantization: str | None  # QUANTIZATION_METHODS, or None: float weights in the dtype
    kv_cache_dtype: str  # KV_CACHE_DTYPES
    reason: str

    @property
    def mode(self) -> str:
        return self.quantization or "none"

    def describe(self) -> str:
        return f"--quantization {self.mode} --kv-cache-dtype {self.kv_cache_dtype} ({self.reason})"


def is_default_model(model: str | None) -> bool:
    from servelab.model.model_path import DEFAULT_MODEL_ALIASES

    return model is None or (not Path(model).expanduser().exists() and str(model).lower() in DEFAULT_MODEL_ALIASES)


def resolve_quantization(args: EngineArgs) -> QuantizationChoice:
    """The mode args ask for, with --quantization auto resolved by the rules above."""
    requested = args.quantization
    kv = args.kv_cache_dtype
    if requested != "auto":
        mode = None if requested in (None, "none") else requested
        return QuantizationChoice(mode, kv, f"--quantization {mode or 'none'} asked for")
    float_weights = lambda why: QuantizationChoice(None, kv, why)  # noqa: E731
    if args.dtype != "auto":
        return float_weights(f"--dtype {args.dtype} asked for")
    if not is_default_model(args.model) and Path(args.model).expanduser().suffix.lower() != ".gguf":
        return float_weights("a Hugging Face folder keeps its float weights")
    from servelab.kernels import cpu_ops

    if cpu_ops() is None:
        return float_weights("servelab's CPU kernels are not available here")
    if not is_default_model(args.model):
        return float_weights("no quantized mode measured for this .gguf file; --quantization int8 or gguf to try one")
    quantization, measured_kv = MEASURED_FASTEST
    return QuantizationChoice(quantization, measured_kv if kv == "auto" else kv,
                              "the default model's fastest measured mode within the perplexity gate")
