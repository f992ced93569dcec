"""Matmul dispatch (bf16 weights on a CPU run through servelab's AVX2 kernel with fp32 activations;
everything else goes to PyTorch) and the tensor-parallel layers that shard weights at load time.
At tensor_parallel_size 1 every layer holds the whole weight and communicates nothing."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from servelab.distributed.parallel_state import TensorParallelGroup
from servelab.kernels import linear_bf16w
from servelab.model.quant.quantization import GGUFWeight, Int8Weight, QuantizedWeight, dequantize_gguf_reference


def compute_dtype(weight_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Activations are fp32 where bf16 weights are widened in registers (the CPU kernel)."""
    if weight_dtype == torch.bfloat16 and device.type == "cpu" and linear_bf16w() is not None:
        return torch.float32
    return weight_dtype


# From this many rows on, widening the whole weight to fp32 and calling MKL's sgemm beats the
# register-widening kernel (measured on this machine's AVX2 CPU: 34 vs 25 GFLOP/s per core at 1024
# rows, even at 128 rows); below it the kernel wins, by 5x at one row where MKL is not memory-bound.
MKL_MIN_ROWS = 128


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, (GGUFWeight, Int8Weight)):
        y = weight.linear(x).to(x.dtype)
        return y if bias is None else y + bias.to(y.dtype)
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu":
        rows = x.numel() // x.shape[-1]
        kernel = linear_bf16w()
        if rows >= MKL_MIN_ROWS or kernel is None:
            return F.linear(x, weight.float(), None if bias is None else bias.float())
        return kernel(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _weight(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantizableLinear(nn.Module):
    """A linear layer's matrix: the float `weight`, or, once quantized, `quantized` (and an empty weight)."""

    weight: nn.Parameter
    quantized: QuantizedWeight | None = None

    @property
    def matrix(self) -> torch.Tensor | QuantizedWeight:
        return self.weight if self.quantized is None else self.quantized

    def _set_quantized(self, quantized: QuantizedWeight) -> None:
        if self.tp.world_size != 1 and not isinstance(quantized, Int8Weight):
            raise ValueError("GGUF blocks run on one rank only (tensor_parallel_size 1)")
        self.quantized = quantized
        self.weight = _weight(0, dtype=self.weight.dtype)

    def quantize_int8(self, smooth: torch.Tensor | None = None) -> None:
        if self.tp.world_size != 1:
            raise ValueError("quantize the whole matrix on one rank, then shard_int8 it")
        self._set_quantized(Int8Weight.from_float(self.weight, smooth))

    def shard_int8(self, full: Int8Weight) -> Int8Weight:
        """This rank's part of the whole matrix's int8 weight (the same values a single rank holds)."""
        raise NotImplementedError


def _fused_parts(parts: list) -> GGUFWeight | list[torch.Tensor]:
    """GGUF parts of one fused matrix stay blocks when they share a type; otherwise all become fp32."""
    if all(isinstance(p, GGUFWeight) for p in parts) and len({(p.gguf_type, p.num_columns) for p in parts}) == 1:
        return GGUFWeight.cat(parts)
    return [dequantize_gguf_reference(p.blocks, p.gguf_type, p.num_columns) if isinstance(p, GGUFWeight) else p
            for p in parts]


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T with W's output rows split: every fused part (q|k|v, gate|up) gives each rank an
    equal slice of its rows, so a rank's output is its slice of y and needs no communication."""

    def __init__(self, input_size: int, output_sizes: tuple[int, ...], tp: TensorParallelGroup,
                 dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = tuple(size // tp.world_size for size in output_sizes)  # this rank's, per part
        self.full_output_sizes = tuple(output_sizes)  # the whole matrix's, per part
        self.weight = _weight(sum(self.output_sizes), input_size, dtype=dtype)  # (sum(output_sizes), input_size)
        self.bias = _weight(sum(self.output_sizes), dtype=dtype) if bias else None

    def shard_start(self, part: int) -> int:
        """First row of this rank's slice within fused part `part` of the full weight."""
        return self.tp.rank * self.output_sizes[part]

    def _shard(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([full.narrow(0, self.shard_start(i), self.output_sizes[i]) for i, full in enumerate(parts)])

    def shard_int8(self, full: Int8Weight) -> Int8Weight:
        rows = lambda t: self._shard(list(t.split(self.full_output_sizes)))  # noqa: E731
        return Int8Weight(rows(full.qweight), rows(full.scale), full.inv_smooth)

    def load(self, weights: list[torch.Tensor | GGUFWeight], biases: list[torch.Tensor] | None = None) -> None:
        """Full (unsharded) weights of each fused part, in order; this rank keeps its rows. GGUF
        blocks of one type are kept as stored."""
        if isinstance(self.quantized, Int8Weight):
            pass  # int8 from the cache already (the float weights were not read)
        elif isinstance(fused := _fused_parts(weights), GGUFWeight):
            self._set_quantized(fused)
        else:
            self.weight.data.copy_(self._shard(fused))
        if self.bias is not None:
            if biases is None:
                raise ValueError("checkpoint has no bias for a layer that takes one")
            self.bias.data.copy_(self._shard(biases))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.matrix, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q|k|v split by heads: a rank holds num_heads / N query heads and the KV heads they read,
    num_kv_heads / N of them, or, when N exceeds num_kv_heads, one KV head copied on
    N / num_kv_heads ranks (vLLM's rule)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TensorParallelGroup, dtype: torch.dtype, bias: bool = False) -> None:
        n = tp.world_size
        self.num_heads = num_heads // n  # this rank's
        self.num_kv_heads = max(1, num_kv_heads // n)
        self.num_kv_head_replicas = max(1, n // num_kv_heads)
        sizes = (num_heads * head_dim, self.num_kv_heads * head_dim * n, self.num_kv_heads * head_dim * n)
        super().__init__(hidden_size, sizes, tp, dtype, bias)
        self.full_output_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)

    def shard_start(self, part: int) -> int:
        if part == 0:
            return self.tp.rank * self.output_sizes[0]
        return self.tp.rank // self.num_kv_head_replicas * self.output_sizes[part]


class RowParallelLinear(QuantizableLinear):
    """y = x W^T with W's input columns split: each rank multiplies its slice of x (the sharded
    output of a ColumnParallelLinear) by its columns, and an all-reduce sums the partial products."""

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size // tp.world_size  # this rank's
        self.weight = _weight(output_size, self.input_size, dtype=dtype)  # (output_size, input_size / N)

    def load(self, weight: torch.Tensor | GGUFWeight | None) -> None:
        if isinstance(self.quantized, Int8Weight):
            return  # int8 from the cache already (the float weights were not read)
        if isinstance(weight, GGUFWeight):
            self._set_quantized(weight)
        else:
            self.weight.data.copy_(weight.narrow(1, self.tp.rank * self.input_size, self.input_size))

    def shard_int8(self, full: Int8Weight) -> Int8Weight:
        start, n = self.tp.rank * self.input_size, self.input_size
        return Int8Weight(full.qweight.narrow(1, start, n).contiguous(), full.scale,
                          None if full.inv_smooth is None else full.inv_smooth.narrow(0, start, n).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, Int8Weight) and self.tp.world_size > 1:
            return self.quantized.linear_row_parallel(x, self.tp).to(x.dtype)  # exact: integers all-reduced
        return self.tp.all_reduce(linear(x, self.matrix))


class VocabParallelEmbedding(QuantizableLinear):
    """Embedding rows split by vocabulary: rank r holds token ids [r * n, (r + 1) * n) with
    n = ceil(vocab_size / N), the last rank's tail padded with zeros. A lookup zeroes the ids other
    ranks hold, and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.num_embeddings = -(-vocab_size // tp.world_size)  # this rank's rows, padding included
        self.vocab_start = tp.rank * self.num_embeddings
        self.vocab_end = min(self.vocab_start + self.num_embeddings, vocab_size)
        self.weight = _weight(self.num_embeddings, hidden_size, dtype=dtype)  # (vocab_size / N, hidden)

    def load(self, weight: torch.Tensor | GGUFWeight | None) -> None:
        if isinstance(self.quantized, Int8Weight):
            return  # an int8 LM head from the cache already (the float weights were not read)
        if isinstance(weight, GGUFWeight):
            self._set_quantized(weight)
            return
        rows = weight[self.vocab_start:self.vocab_end]
        self.weight.data[len(rows):].zero_()
        self.weight.data[:len(rows)].copy_(rows)

    def shard_int8(self, full: Int8Weight) -> Int8Weight:
        """This rank's vocabulary rows; the last rank's padding rows are zero."""
        pad = self.num_embeddings - (self.vocab_end - self.vocab_start)
        qweight, scale = full.qweight[self.vocab_start:self.vocab_end], full.scale[self.vocab_start:self.vocab_end]
        return Int8Weight(F.pad(qweight, (0, 0, 0, pad)).contiguous(), F.pad(scale, (0, pad), value=1.0).contiguous(),
                          full.inv_smooth)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, GGUFWeight):
            return self.quantized.rows(input_ids)
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        elsewhere = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(elsewhere, 0)
        x = F.embedding(local_ids, self.weight).masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection split like the embedding: each rank computes the logits of its
    vocabulary slice; the first rank gathers the slices (dropping the padding) to sample from."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def tie_quantized(self, embedding: VocabParallelEmbedding) -> None:
        """A tied head reads the embedding's GGUF blocks (after both loaded)."""
        if embedding.quantized is not None:
            self.quantized, self.weight = embedding.quantized, embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits (num_rows, vocab_size) on the first rank, None on the others."""
        logits = linear(hidden, self.matrix)
        if self.tp.world_size == 1:
            return logits
        logits = self.tp.gather_last_dim(logits)
        return None if logits is None else logits[:, :self.vocab_size]
