"""Quantized linear weights, chosen with vLLM's --quantization flag.

gguf: the GGUF file's own blocks (Q8_0, Q4_0, Q4_1, Q4_K), kept as stored; servelab's C++ kernel
      multiplies fp32 activations by them, widening each block in registers (kernels/quant_blocks.h).
      The PyTorch de-quantizers below are its reference and its fallback where the kernels cannot build.
int8: W8A8 dynamic: int8 weights with one scale per output channel, activations quantized per token
      (one scale per row) at each call, int8 x int8 -> int32 through torch._int_mm (oneDNN on CPU); the
      passes before and after it are servelab's kernels (kernels/int8_rows.cpp), the functions below
      their reference. SmoothQuant factors (smooth_quant.py) move activation outliers into the weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.config import QUANTIZATION_METHODS  # noqa: F401  (re-exported for the model)

# ggml type id -> (values per block, bytes per block)
GGUF_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144)}
GGUF_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K"}


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as fp32 (..., 1)."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def _q4k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's get_scale_min_k4 for all eight sub-blocks: (..., 12) bytes -> two (..., 8)."""
    s = scales.to(torch.int32)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1).float(), torch.cat([low_m, high_m], -1).float()


def dequantize_gguf_reference(blocks: torch.Tensor, gguf_type: int, num_columns: int) -> torch.Tensor:
    """(N, row bytes) uint8 blocks -> (N, num_columns) fp32, as llama.cpp's dequantize_row_* computes them."""
    values, nbytes = GGUF_BLOCKS[gguf_type]
    b = blocks.reshape(blocks.shape[0], num_columns // values, nbytes)
    if gguf_type == 8:  # Q8_0
        w = _fp16(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()
    elif gguf_type in (2, 3):  # Q4_0, Q4_1: low nibbles are values 0-15, high nibbles 16-31
        qs = b[..., 4:] if gguf_type == 3 else b[..., 2:]
        q = torch.cat([qs & 0xF, qs >> 4], -1).float()
        w = _fp16(b, 0) * q + (_fp16(b, 2) if gguf_type == 3 else -8 * _fp16(b, 0))
    else:  # Q4_K: 8 sub-blocks of 32; in each 64-value chunk, low nibbles first, then high nibbles
        sc, m = _q4k_scales_mins(b[..., 4:16])
        qs = b[..., 16:].reshape(*b.shape[:2], 4, 1, 32)
        q = torch.cat([qs & 0xF, qs >> 4], -2).reshape(*b.shape[:2], 8, 32).float()
        w = _fp16(b, 0).unsqueeze(-1) * sc.unsqueeze(-1) * q - (_fp16(b, 2).unsqueeze(-1) * m.unsqueeze(-1))
    return w.reshape(blocks.shape[0], num_columns)


@dataclass
class GGUFWeight:
    """A (num_rows, num_columns) matrix as the GGUF file stores it: num_rows rows of blocks.

    int8_inputs: products of up to 4 rows (decode steps) round their inputs to 8 bits per 32 values
    and multiply in integers, as llama.cpp does; set for every dtype but float32, which stays exact."""
    blocks: torch.Tensor  # (num_rows, row bytes) uint8
    gguf_type: int
    num_columns: int
    int8_inputs: bool = False

    def __post_init__(self) -> None:
        if self.gguf_type not in GGUF_BLOCKS:
            raise ValueError(f"GGUF type {self.gguf_type} is not supported by --quantization gguf "
                             f"(supported: {', '.join(GGUF_TYPE_NAMES.values())})")
        values, nbytes = GGUF_BLOCKS[self.gguf_type]
        if self.num_columns % values or self.blocks.shape[1] != self.num_columns // values * nbytes:
            raise ValueError(f"{GGUF_TYPE_NAMES[self.gguf_type]} blocks {tuple(self.blocks.shape)} do not hold "
                             f"rows of {self.num_columns} values")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.num_columns)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @staticmethod
    def cat(parts: list["GGUFWeight"]) -> "GGUFWeight":
        """Rows of several matrices stacked (q|k|v, gate|up): they must share type and width."""
        if len({(p.gguf_type, p.num_columns) for p in parts}) != 1:
            names = ", ".join(GGUF_TYPE_NAMES.get(p.gguf_type, str(p.gguf_type)) for p in parts)
            raise ValueError(f"fused GGUF matrices must share one type and width; got {names}")
        return GGUFWeight(torch.cat([p.blocks for p in parts]), parts[0].gguf_type, parts[0].num_columns)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows `ids` (an embedding lookup)."""
        from servelab.kernels import cpu_ops

        ops, picked = cpu_ops(), self.blocks[ids.reshape(-1)]
        if ops is None:
            out = dequantize_gguf_reference(picked, self.gguf_type, self.num_columns)
        else:
            out = ops.dequantize_gguf(picked, self.gguf_type, self.num_columns)
        return out.view(*ids.shape, self.num_columns)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        from servelab.kernels import cpu_ops

        ops, flat = cpu_ops(), x.reshape(-1, x.shape[-1]).float()
        if ops is None:
            y = F.linear(flat, dequantize_gguf_reference(self.blocks, self.gguf_type, self.num_columns))
        else:
            y = ops.linear_gguf(flat, self.blocks, self.gguf_type, self.int8_inputs)
        return y.view(*x.shape[:-1], self.blocks.shape[0])


@dataclass
class Int8Weight:
    """W8A8 dynamic: w ~ qweight * scale[:, None], scale per output channel (symmetric, [-127, 127]).

    With SmoothQuant's per-input-channel factors s (smooth_quant.py) the stored matrix is w * s and
    every activation row is multiplied by inv_smooth = 1 / s before it is quantized: the product is
    unchanged, and the activations' outlier channels shrink into the weights."""
    qweight: torch.Tensor  # (num_rows, num_columns) int8: w's (N, K), as _int_mm takes transposed and int8_matmul_rows as is
    scale: torch.Tensor  # (num_rows,) fp32
    inv_smooth: torch.Tensor | None = None  # (num_columns,) fp32

    @classmethod
    def from_float(cls, weight: torch.Tensor, smooth: torch.Tensor | None = None) -> "Int8Weight":
        w = weight.float() if smooth is None else weight.float() * smooth.float()[None, :]
        scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scale, None if smooth is None else 1 / smooth.float())

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.inv_smooth is None else self.inv_smooth.numel() * 4
        return self.qweight.numel() + self.scale.numel() * 4 + extra

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        from servelab.kernels import cpu_ops

        ops, flat = cpu_ops(), x.reshape(-1, x.shape[-1]).float()
        if ops is None:
            x_q, x_scale = quantize_per_token(flat if self.inv_smooth is None else flat * self.inv_smooth)
            y = int8_matmul(x_q, self.qweight).float()
            y.mul_(x_scale).mul_(self.scale)
        else:
            y = self.linear_int8(*ops.quantize_rows_int8(flat, self.inv_smooth))
        return y.view(*x.shape[:-1], self.qweight.shape[0])

    def matmul_int32(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, K) fp32 quantized per row (servelab's kernel) times the int8 weight: the int32 accumulators
        (M, N) and the rows' scales (M, 1), for a caller that fuses what follows (silu_mul_quantize_int8)."""
        from servelab.kernels import cpu_ops

        x_q, x_scale = cpu_ops().quantize_rows_int8(x, self.inv_smooth)
        return int8_matmul(x_q, self.qweight), x_scale

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Per row of x (M, K), the index of linear(x)'s largest value (the first of equal ones), without its fp32
        rows: the LM head of a greedy step (servelab's kernels)."""
        from servelab.kernels import cpu_ops

        return cpu_ops().argmax_rows_int32(*self.matmul_int32(x.reshape(-1, x.shape[-1]).float()), self.scale)

    def linear_row_parallel(self, x: torch.Tensor, tp) -> torch.Tensor:
        """This rank's columns of x (M, K / N) times its columns of the weight, summed over the ranks: the same
        fp32 (M, num_rows) as linear() of the whole row on one rank, bit for bit. Each row is quantized with the
        maximum over every rank's columns (an all-reduce of M values) and the int32 products are summed exactly
        (an all-reduce of integers), before the one de-quantization linear_int8 does."""
        flat = x.reshape(-1, x.shape[-1]).float()
        if self.inv_smooth is not None:
            flat = flat * self.inv_smooth
        scale = tp.all_reduce_max(flat.abs().amax(dim=1, keepdim=True)).clamp_(min=1e-8) / 127
        x_q = torch.round(flat / scale).clamp_(-127, 127).to(torch.int8)
        y = tp.all_reduce(int8_matmul(x_q, self.qweight)).float()
        y.mul_(scale).mul_(self.scale)
        return y.view(*x.shape[:-1], self.qweight.shape[0])

    def linear_int8(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """Already-quantized rows (M, K) int8 with scales (M, 1) times the weight: fp32 (M, N)."""
        from servelab.kernels import cpu_ops

        return cpu_ops().dequantize_rows_int32(int8_matmul(x_q, self.qweight), x_scale, self.scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) fp32 -> (M, K) int8 and (M, 1) scales: each row by its own absolute maximum."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8) / 127
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


# torch._int_mm wants more than 16 rows on some builds; fewer (a decode step of a few sequences) run servelab's
# kernel, which gives the same int32 sums, or are padded where the kernels are not built.
INT_MM_MIN_ROWS = 17


def int8_matmul(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(M, K) int8 @ weight (N, K) int8 transposed -> (M, N) int32; a's values in [-127, 127]."""
    rows = a.shape[0]
    if rows < INT_MM_MIN_ROWS:
        from servelab.kernels import cpu_ops

        ops = cpu_ops()
        if ops is not None:
            return ops.int8_matmul_rows(a.contiguous(), weight)
        a = F.pad(a, (0, 0, 0, INT_MM_MIN_ROWS - rows))
    return torch._int_mm(a, weight.t())[:rows]


QuantizedWeight = GGUFWeight | Int8Weight
