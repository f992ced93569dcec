"""Matmul dispatch: bf16 weights on a CPU without native bf16 run through servelab's AVX2 kernel
with fp32 activations; everything else goes to PyTorch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from servelab.kernels import linear_bf16w


def compute_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Activations are fp32 where bf16 weights are widened in registers (the CPU kernel)."""
    if weight_dtype == torch.bfloat16 and device.type == "cpu" and linear_bf16w() is not None:
        return torch.float32
    return weight_dtype


# From this many rows on, widening the whole weight to fp32 and calling MKL's sgemm beats the
# register-widening kernel (measured on this machine's AVX2 CPU: 34 vs 25 GFLOP/s per core at 1024
# rows, even at 128 rows); below it the kernel wins, by 5x at one row where MKL is not memory-bound.
MKL_MIN_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu":
        rows = x.numel() // x.shape[-1]
        kernel = linear_bf16w()
        if rows >= MKL_MIN_ROWS or kernel is None:
            return F.linear(x, weight.float(), None if bias is None else bias.float())
        return kernel(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
