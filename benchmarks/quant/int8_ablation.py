"""Where --quantization int8 loses perplexity, and what SmoothQuant's alpha does about it (README's
"Where int8 lost perplexity" tables). One bf16 model is loaded; each variant re-quantizes its matrices
from the kept float weights and scores the perplexity text as `servelab bench perplexity` does.

    python benchmarks/quant/int8_ablation.py --ctx 256 none:q/k/v... (see --help)

A variant is ALPHA:MATRICES: ALPHA "none" (per-token W8A8 only) or a number; MATRICES "all", "only=a,b"
(int8 on those, the rest bf16) or "skip=a,b" (those stay bf16), names matched as suffixes of
layers.<i>.qkv_proj | o_proj | gate_up_proj | down_proj | head. Run it under the bench lock."""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from servelab.bench.perplexity import TEXT, chunk_nll, chunks
from servelab.engine.llm_engine import LLMEngine
from servelab.engine_args import EngineArgs
from servelab.model.quant.smooth_quant import CALIBRATION_TEXT, smoothing_factors

DEFAULT_VARIANTS = ["none:only=qkv_proj", "none:only=o_proj", "none:only=gate_up_proj", "none:only=down_proj",
                    "none:only=head", "none:all", "0.4:all", "0.5:all", "0.55:all", "0.6:all", "0.65:all",
                    "0.7:all", "0.75:all", "0.5:skip=down_proj", "0.6:skip=head"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--text", type=Path, default=TEXT, help="text to score (default: the perplexity text)")
    args = p.parse_args()
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="bfloat16", max_model_len=args.ctx,
                                                   num_kv_blocks=-(-args.ctx // 16)))
    executor, model = engine.executor, engine.executor.model
    model._decode_runner = None  # every matrix must go through the layers below
    parts = chunks(engine.tokenizer.encode(args.text.read_text(encoding="utf-8")), args.ctx)
    absmax = executor.linear_input_absmax(engine.tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8")))
    named = model.named_linear_layers()
    float_weights = {name: linear.weight for name, linear in named.items()}

    def perplexity() -> float:
        total, count = 0.0, 0
        for part in parts:
            nll, n = chunk_nll(executor.prompt_logits(part), part)
            total, count = total + nll, count + n
        return math.exp(total / count)

    for name in named:
        ratio = absmax[name].max() / absmax[name].median()
        print(f"input max/median {name:24s} {ratio:8.1f}")
    bf16 = perplexity()
    print(f"bf16 {bf16:.3f}")
    for variant in args.variants:
        alpha_text, matrices = variant.split(":")
        alpha = None if alpha_text == "none" else float(alpha_text)
        kind, _, listed = matrices.partition("=")
        suffixes = tuple(listed.split(",")) if listed else ()
        for name, linear in named.items():
            linear.quantized, linear.weight = None, float_weights[name]
            if kind == "only" and not name.endswith(suffixes) or kind == "skip" and name.endswith(suffixes):
                continue
            linear.quantize_int8(None if alpha is None else smoothing_factors(absmax[name], linear.weight, alpha))
        value = perplexity()
        print(f"{variant:32s} {value:.3f} {100 * (value / bf16 - 1):+.2f}%", flush=True)


if __name__ == "__main__":
    main()
