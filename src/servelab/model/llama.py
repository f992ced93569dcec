"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Inputs are flattened across the batch: one row per token being computed this step.
Weights are fused at load time (q|k|v, gate|up) so a layer is two big matmuls and two small ones.
Under tensor parallelism each rank builds the same model from its TensorParallelGroup: the shapes
below are one rank's (heads, KV heads, MLP columns and vocabulary divided by N), and a layer does
two all-reduces, after o_proj and after down_proj.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from servelab.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from servelab.kernels import cpu_ops
from servelab.model.attention import INT8_SCALE_BYTES, AttentionMetadata, paged_attention, prefill_attention, write_kv
from servelab.model.layers import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding, compute_dtype)
from servelab.model.quant.quantization import INT_MM_MIN_ROWS, QUANTIZATION_METHODS, GGUFWeight, Int8Weight, int8_matmul
from servelab.model.quant.smooth_quant import SMOOTHQUANT_ALPHA, smoothing_factors

BF16 = 30  # ggml's type id, which DecodeRunner takes for bf16 matrices
from servelab.specs import ModelSpec


def rope_inv_freq(config: ModelSpec) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale, as Hugging Face computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(config.rope_scaling or ())
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type is None:
        return inv_freq, 1.0
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (servelab supports default, linear, llama3)")


class RotaryEmbedding:
    def __init__(self, config: ModelSpec, max_positions: int, dtype: torch.dtype) -> None:
        inv_freq, scale = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (T, H, hd), k: (T, kvh, hd)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's order of operations: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelSpec, dtype: torch.dtype, tp: TensorParallelGroup) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.input_norm = empty(h)  # norms are replicated on every rank
        self.post_attention_norm = empty(h)
        # (q_size + 2 * kv_size, h): this rank's query heads and the KV heads they read
        self.qkv_proj = QKVParallelLinear(h, hd, config.num_attention_heads, config.num_key_value_heads, tp, dtype,
                                          bias=config.attention_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, hd
        self.q_size, self.kv_size = self.num_heads * hd, self.num_kv_heads * hd
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, h, tp, dtype)  # (h, q_size), all-reduce
        # (2 * intermediate_size / N, h) and (h, intermediate_size / N), all-reduce
        self.gate_up_proj = ColumnParallelLinear(h, (config.intermediate_size,) * 2, tp, dtype)
        self.down_proj = RowParallelLinear(config.intermediate_size, h, tp, dtype)
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        hidden = rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, kv_cache, meta).view(num_tokens, self.q_size)
        x = x + self.o_proj(attn)
        hidden = rms_norm(x, self.post_attention_norm, self.eps)
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      rope: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata, ops,
                      norms: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer through servelab's CPU ops (vLLM's residual-stream form): x enters as the
        previous layer's output (or the embeddings) and leaves un-added; residual carries the sum."""
        if residual is None:
            residual, x = x, ops.rms_norm(x, norms[0], self.eps)
        else:
            ops.add_rms_norm_(x, residual, norms[0], self.eps)
        attn = self._attention_fused(self.qkv_proj(x), positions, rope, kv_cache, meta, ops)
        x = self.o_proj(attn)
        ops.add_rms_norm_(x, residual, norms[1], self.eps)
        gate_up, down = self.gate_up_proj.quantized, self.down_proj.quantized
        if isinstance(gate_up, Int8Weight) and isinstance(down, Int8Weight) and self.down_proj.tp.world_size == 1:
            # W8A8 (one rank only): int32 accumulators to down_proj's int8 input in one pass.
            acc, x_scale = gate_up.matmul_int32(x)
            x = down.linear_int8(*ops.silu_mul_quantize_int8(acc, x_scale, gate_up.scale, down.inv_smooth))
        else:
            x = self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        return x, residual

    def _attention_fused(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                         kv_cache: torch.Tensor, meta: AttentionMetadata, ops) -> torch.Tensor:
        """RoPE and the KV-cache write in place on qkv, then paged attention of its q rows: (tokens, q_size)."""
        ops.rope_and_cache_(qkv, positions, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, kv_cache,
                            meta.slot_mapping)
        q = qkv[:, :self.q_size]
        num_decode = meta.num_decode_tokens
        if not meta.prefills:
            return ops.paged_decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                                              self.num_heads)
        attn = torch.empty(q.shape, dtype=q.dtype)
        if num_decode:
            attn[:num_decode] = ops.paged_decode_attention(
                q[:num_decode], kv_cache, meta.decode_block_tables, meta.decode_context_lens, self.num_heads)
        if self.head_dim % 16 == 0:  # servelab's tiled kernel; PyTorch's SDPA otherwise
            attn[num_decode:] = ops.prefill_attention(q[num_decode:], kv_cache, *meta.packed_prefills(),
                                                      self.num_heads)
        else:
            qp = q[num_decode:].reshape(-1, self.num_heads, self.head_dim)
            attn[num_decode:] = prefill_attention(qp, kv_cache, meta.prefills, num_decode).flatten(1)
        return attn

    def forward_w8a8(self, x, residual: torch.Tensor | None, positions: torch.Tensor, rope: RotaryEmbedding,
                     kv_cache: torch.Tensor, meta: AttentionMetadata, ops, norms: tuple[torch.Tensor, torch.Tensor]):
        """forward_fused for a layer whose four matrices are all Int8Weight (one rank, no qkv bias), with
        the same results bit for bit: between two matrices, de-quantization, the residual add, the norm and
        the next quantization are one call (dequant_add_rms_norm_quantize_int8). x enters as the previous
        layer's down_proj accumulators (acc, row scales, column scales), or as the embeddings before the
        first layer, and leaves as this layer's. A decode-only step runs all layers at once instead
        (ops.w8a8_decode_layers, the same ops from C++)."""
        qkv_w, o_w = self.qkv_proj.quantized, self.o_proj.quantized
        gate_up, down = self.gate_up_proj.quantized, self.down_proj.quantized
        if residual is None:
            residual = x
            x_q, x_scale = ops.quantize_rows_int8(ops.rms_norm(x, norms[0], self.eps), qkv_w.inv_smooth)
        else:
            x_q, x_scale = ops.dequant_add_rms_norm_quantize_int8(*x, residual, norms[0], self.eps, qkv_w.inv_smooth)
        attn = self._attention_fused(qkv_w.linear_int8(x_q, x_scale), positions, rope, kv_cache, meta, ops)
        acc, a_scale = o_w.matmul_int32(attn)
        x_q, x_scale = ops.dequant_add_rms_norm_quantize_int8(acc, a_scale, o_w.scale, residual, norms[1], self.eps,
                                                              gate_up.inv_smooth)
        h_q, h_scale = ops.silu_mul_quantize_int8(int8_matmul(x_q, gate_up.qweight), x_scale, gate_up.scale,
                                                  down.inv_smooth)
        return (int8_matmul(h_q, down.qweight), h_scale, down.scale), residual

    @property
    def is_w8a8(self) -> bool:
        """Every matrix W8A8, one rank and no qkv bias: forward_w8a8 applies."""
        return self.qkv_proj.bias is None and self.qkv_proj.tp.world_size == 1 and all(
            isinstance(m.quantized, Int8Weight) for m in (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelSpec, dtype: torch.dtype, max_positions: int,
                 tp: TensorParallelGroup = SINGLE_RANK, quantization: str | None = None) -> None:
        super().__init__()
        if quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.quantization = quantization
        self.embedding = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, tp) for _ in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype), requires_grad=False)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype)
        if config.tie_word_embeddings:
            self.head.tie_weights(self.embedding)
        # Weights (and the KV cache) are stored in dtype; activations run in compute_dtype.
        self.compute_dtype = compute_dtype(dtype, torch.device("cpu"))
        # bf16 weights on a CPU with servelab's ops take the fused path; fp32 stays on the
        # PyTorch reference path, which matches Hugging Face bit for bit.
        self.ops = cpu_ops() if dtype == torch.bfloat16 and self.compute_dtype == torch.float32 else None
        self._fused_norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._decode_runner = None  # the fused path's single-sequence decode step, set by load_weights
        self._w8a8_layers = None  # every layer's W8A8 tensors for one-call decode steps, set by quantize_int8
        # True: in a one-call W8A8 decode step each layer's attention prefetches the matrices that run after it
        # (from DRAM their GEMMs take ~30% longer at batch 64). Off: since decode attention prefetches its K rows
        # into L2, the two compete for misses in flight and the step measured no faster with it (int8 KV) or
        # ~2.8 ms slower (bf16 KV); benchmarks/decode_step_parts/run.py --parts prefetch compares the two.
        self.prefetch_weights = False
        self.rope = RotaryEmbedding(config, max_positions, self.compute_dtype)

    @property
    def embed_tokens(self) -> nn.Parameter:
        """This rank's embedding rows (num_embeddings, hidden): all of them at tensor_parallel_size 1."""
        return self.embedding.weight

    @property
    def lm_head(self) -> nn.Parameter:
        return self.head.weight

    def kv_cache_shape(self, num_blocks: int, block_size: int, cache_dtype: str = "auto") -> tuple[int, ...]:
        """One layer's KV cache on this rank: its KV heads only; an int8 row carries its scale (attention.py)."""
        layer = self.layers[0]
        row = layer.head_dim + (INT8_SCALE_BYTES if cache_dtype == "int8" else 0)
        return (2, num_blocks, block_size, layer.num_kv_heads, row)

    def kv_cache_dtype(self, cache_dtype: str = "auto") -> torch.dtype:
        """The KV cache's element type for --kv-cache-dtype: the model's dtype for "auto"."""
        return torch.int8 if cache_dtype == "int8" else self.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (num_tokens,). Returns final-normed hidden states (num_tokens, hidden)."""
        if self._decode_runner is not None and meta.num_decode_tokens == 1 and not meta.prefills:
            # One sequence decoding (batch 1): the whole step is one C++ call, see kernels/decode_step.cpp.
            return self._decode_runner.forward(input_ids.item(), positions.item(), meta.slot_mapping.item(),
                                               meta.decode_block_tables, kv_caches)
        x = self.embedding(input_ids).to(self.compute_dtype)
        if self.ops is not None:
            return self._forward_fused(x, positions, kv_caches, meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kv_cache, meta)
        return rms_norm(x, self.norm, self.config.rms_norm_eps)

    def _forward_fused(self, x, positions, kv_caches, meta) -> torch.Tensor:
        if self._w8a8_layers is not None and not meta.prefills:
            # A W8A8 decode step: all layers in one C++ call, the same ops as forward_w8a8's in the same order.
            first = self.layers[0]
            acc, row_scales, col_scales, residual = self.ops.w8a8_decode_layers(
                x, self._w8a8_layers, positions, self.rope.cos, self.rope.sin, first.num_heads, first.num_kv_heads,
                kv_caches, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                self.config.rms_norm_eps, self.prefetch_weights, INT_MM_MIN_ROWS)
            x = self.ops.dequantize_rows_int32(acc, row_scales, col_scales)
            self.ops.add_rms_norm_(x, residual, self._final_norm, self.config.rms_norm_eps)
            return x
        residual = None
        for layer, kv_cache, norms in zip(self.layers, kv_caches, self._fused_norms):
            if layer.is_w8a8 and (residual is None or isinstance(x, tuple)):
                x, residual = layer.forward_w8a8(x, residual, positions, self.rope, kv_cache, meta, self.ops, norms)
                continue
            if isinstance(x, tuple):  # a W8A8 layer's down_proj accumulators
                x = self.ops.dequantize_rows_int32(*x)
            x, residual = layer.forward_fused(x, residual, positions, self.rope, kv_cache, meta, self.ops, norms)
        if isinstance(x, tuple):
            x = self.ops.dequantize_rows_int32(*x)
        self.ops.add_rms_norm_(x, residual, self._final_norm, self.config.rms_norm_eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: final-normed states of the rows to sample (forward() applies the final norm).
        Full-vocabulary logits on the first rank; None on the other ranks."""
        if self._decode_runner is not None and hidden.shape[0] == 1:
            return self._decode_runner.logits(hidden)
        return self.head.compute_logits(hidden)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of compute_logits(hidden) per row, where the head gives it without fp32 logits (a W8A8 head
        on one rank with servelab's ops: 64 rows x 49,152 logits are 12.6 MB written and read again); None elsewhere."""
        head = self.head.quantized
        if (self.ops is None or self.tp.world_size != 1 or not isinstance(head, Int8Weight)
                or head.qweight.shape[0] != self.config.vocab_size):
            return None
        return head.greedy_tokens(hidden)

    def linear_layers(self) -> list:
        return list(self.named_linear_layers().values())

    def named_linear_layers(self) -> dict[str, nn.Module]:
        """Every matrix multiplied by activations, by name ("layers.3.down_proj", "head")."""
        names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        named = {f"layers.{i}.{n}": getattr(layer, n) for i, layer in enumerate(self.layers) for n in names}
        return {**named, "head": self.head}

    def quantize_int8(self, input_absmax: dict[str, torch.Tensor] | None = None,
                      alpha: float = SMOOTHQUANT_ALPHA) -> None:
        """W8A8 every matrix; one with calibrated input statistics is SmoothQuant-smoothed first."""
        for name, linear in self.named_linear_layers().items():
            absmax = None if input_absmax is None else input_absmax.get(name)
            linear.quantize_int8(None if absmax is None else smoothing_factors(absmax, linear.weight, alpha))
        self._w8a8_layers = self._gather_w8a8_layers()

    def int8_state(self) -> dict[str, torch.Tensor]:
        """Every int8 matrix's tensors by name ("layers.3.down_proj.qweight", ...), as load_int8 takes them."""
        state = {}
        for name, linear in self.named_linear_layers().items():
            w = linear.quantized
            state |= {f"{name}.qweight": w.qweight, f"{name}.scale": w.scale}
            if w.inv_smooth is not None:
                state[f"{name}.inv_smooth"] = w.inv_smooth
        return state

    def load_int8(self, state: dict[str, torch.Tensor]) -> bool:
        """quantize_int8's result on one rank, from int8_state's tensors, each rank keeping its part (so every
        tensor-parallel size holds the same int8 values); False (nothing changed) when a matrix is missing or its
        part has another shape than this rank's weight."""
        shards = {}
        for name, linear in self.named_linear_layers().items():
            if f"{name}.qweight" not in state:
                return False
            full = Int8Weight(state[f"{name}.qweight"], state[f"{name}.scale"], state.get(f"{name}.inv_smooth"))
            try:
                shards[name] = full if self.tp.world_size == 1 else linear.shard_int8(full)
            except RuntimeError:  # a matrix of another size: another model
                return False
            if tuple(shards[name].qweight.shape) != tuple(linear.weight.shape):
                return False
        for name, linear in self.named_linear_layers().items():
            linear._set_quantized(shards[name])
        self._w8a8_layers = self._gather_w8a8_layers()
        return True

    def _gather_w8a8_layers(self) -> list[list[torch.Tensor]] | None:
        """Every layer's norms and int8 matrices as ops.w8a8_decode_layers takes them, where a decode-only step can
        run all layers in one C++ call: servelab's ops, one rank, every layer W8A8."""
        if self.ops is None or self.tp.world_size != 1 or not all(layer.is_w8a8 for layer in self.layers):
            return None
        none = torch.empty(0)
        stack = []
        for layer, norms in zip(self.layers, self._fused_norms):
            tensors = list(norms)
            for linear in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                w = linear.quantized
                tensors += [w.qweight, w.scale, none if w.inv_smooth is None else w.inv_smooth]
            stack.append(tensors)
        return stack

    def weight_bytes(self) -> int:
        """Bytes of every weight held, each shared tensor once: quantized blocks at their stored size."""
        tensors = {id(p): p.numel() * p.element_size() for p in self.parameters()}
        for module in (self.embedding, *self.linear_layers()):
            if module.quantized is not None:
                tensors[id(module.quantized)] = module.quantized.nbytes
        return sum(tensors.values())

    def load_weights(self, state_dict: dict[str, "torch.Tensor | GGUFWeight"]) -> None:
        """Copy Hugging Face-named (full, unsharded) tensors in; each parallel layer keeps this rank's
        slice, fusing q|k|v and gate|up. GGUF blocks (quantization "gguf") are kept as stored;
        quantization "int8" keeps float weights until quantize_int8 (after calibration). Missing or
        unexpected names raise."""
        sd = {k.removeprefix("model."): v for k, v in state_dict.items()}  # copy_ casts to self.dtype
        self.embedding.load(sd.pop("embed_tokens.weight"))
        self.norm.data.copy_(sd.pop("norm.weight"))
        has_head = "lm_head.weight" in sd  # its value is None where an int8 head from the cache replaces it
        head = sd.pop("lm_head.weight", None)
        if not self.config.tie_word_embeddings:
            if not has_head:
                raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
            self.head.load(head)
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            take = lambda name: sd.pop(p + name)  # noqa: E731
            layer.input_norm.data.copy_(take("input_layernorm.weight"))
            layer.post_attention_norm.data.copy_(take("post_attention_layernorm.weight"))
            biases = [take(f"self_attn.{n}_proj.bias") for n in "qkv"] if layer.qkv_proj.bias is not None else None
            layer.qkv_proj.load([take(f"self_attn.{n}_proj.weight") for n in "qkv"], biases)
            layer.o_proj.load(take("self_attn.o_proj.weight"))
            layer.gate_up_proj.load([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])
            layer.down_proj.load(take("mlp.down_proj.weight"))
        leftover = [k for k in sd if "rotary_emb" not in k]
        if leftover:
            raise ValueError(f"unexpected weights in checkpoint: {leftover[:5]}")
        if self.config.tie_word_embeddings:
            self.head.tie_quantized(self.embedding)
        for module in (self.embedding, *self.linear_layers()):
            if isinstance(module.quantized, GGUFWeight):
                module.quantized.int8_inputs = self.dtype != torch.float32
        if self.ops is not None:
            self._fused_norms = [(lay.input_norm.float(), lay.post_attention_norm.float()) for lay in self.layers]
            self._final_norm = self.norm.float()
            # One C++ call per step has no room for all-reduces: the single-process engine only.
            if self.tp.world_size == 1 and self.quantization != "int8":
                self._decode_runner = self._build_decode_runner()
            if self.layers[0].qkv_proj.quantized is not None:  # int8 loaded before the float weights (the cache)
                self._w8a8_layers = self._gather_w8a8_layers()

    def _build_decode_runner(self):
        """The fused path's decode step of one sequence as one C++ call (kernels/decode_step.cpp), on
        its own packed copy of the bf16 matrices; None where the shapes do not suit its GEMVs (16
        columns at a time, rows in groups of 4)."""
        cfg = self.config
        columns = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim)
        rows = (cfg.hidden_size, cfg.intermediate_size, self.layers[0].qkv_proj.weight.shape[0], cfg.vocab_size)
        if any(c % 16 for c in columns) or any(r % 4 for r in rows):
            return None
        runner = self.ops.DecodeRunner(*_runner_matrix(self.embedding), *_runner_matrix(self.head), self._final_norm,
                                       self.rope.cos, self.rope.sin, cfg.num_attention_heads,
                                       cfg.num_key_value_heads, cfg.rms_norm_eps,
                                       self.dtype != torch.float32)
        for layer, (input_norm, post_norm) in zip(self.layers, self._fused_norms):
            bias = None if layer.qkv_proj.bias is None else layer.qkv_proj.bias.float()
            (qkv, qkv_type), (o, o_type), (gate_up, gate_up_type), (down, down_type) = (
                _runner_matrix(lin) for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
            runner.add_layer(input_norm, qkv, bias, o, post_norm, gate_up, down,
                             [qkv_type, o_type, gate_up_type, down_type])
        return runner


def _runner_matrix(linear) -> tuple[torch.Tensor, int]:
    """A matrix as DecodeRunner takes it: GGUF blocks and their type, or bf16 weights."""
    if isinstance(linear.quantized, GGUFWeight):
        return linear.quantized.blocks, linear.quantized.gguf_type
    return linear.weight, BF16
