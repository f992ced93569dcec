"""SmoothQuant (Xiao et al., 2023, arXiv:2211.10438) for --quantization int8.

A few input channels of a linear layer carry activations tens of times larger than the rest, in
every token; one int8 scale per token then spends its range on them and rounds the other channels
away. SmoothQuant divides each input channel j of the activations by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

and multiplies column j of the weight by it, so the product is unchanged and the outliers are shared
between activations and weights. max|X_j| is measured once, at load, on a short calibration text
(data/int8_calibration.txt: the first chapter of Jane Austen's Pride and Prejudice, 1813, and the
opening of Lewis Carroll's Alice's Adventures in Wonderland, 1865; both public domain, typed in, so
punctuation may differ from Project Gutenberg's editions #1342 and #11), never on the perplexity text. The
statistics and the int8 weights are cached by the model's content hash (quant_cache.py).

Production stacks fold 1 / s into the preceding RMSNorm's weight; servelab multiplies it into the
activations inside the quantizing pass instead (kernels/int8_rows.cpp), where it costs one multiply
per value already in a register, and so smooths o_proj and down_proj too, which no norm precedes."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

CALIBRATION_TEXT = Path(__file__).parents[1] / "data" / "int8_calibration.txt"  # in model/data/
# Migration strength. The paper and llm-compressor default to 0.5; on SmolLM2-135M a sweep of 0.4-0.75
# put the least perplexity at 0.6-0.65, on the perplexity text and on the calibration text alike (README).
SMOOTHQUANT_ALPHA = 0.6
# The calibration text is prefilled in chunks this long, each from position 0, over a KV cache of its own.
CALIBRATION_CHUNK_TOKENS = 512
_MIN = 1e-5


def smoothing_factors(input_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHQUANT_ALPHA
                      ) -> torch.Tensor:
    """(K,) factors s for a (N, K) weight whose inputs reached input_absmax (K,) per channel."""
    weight_absmax = weight.float().abs().amax(dim=0).clamp(min=_MIN)
    s = input_absmax.float().clamp(min=_MIN).pow(alpha) / weight_absmax.pow(1 - alpha)
    return s.clamp(min=_MIN)


class InputAbsMax:
    """Records max |x| per input channel of each named module's input while it is active (forward
    pre-hooks that only read; removed on exit). record() adds inputs that are not a module call
    (the LM head's, which compute_logits multiplies directly)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.absmax: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def record(self, name: str, x: torch.Tensor) -> None:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        previous = self.absmax.get(name)
        self.absmax[name] = seen if previous is None else torch.maximum(previous, seen)

    def __enter__(self) -> "InputAbsMax":
        for name, module in self.modules.items():
            hook = lambda _module, args, name=name: self.record(name, args[0])  # noqa: E731
            self._handles.append(module.register_forward_pre_hook(hook))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
