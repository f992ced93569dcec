"""CostModel: prices a step from its contents (the executor that uses it: executor/cost_model_executor.py).

Per step, on each of the tp GPUs of an instance (they work in parallel):
  weights:       per layer max(matmul FLOPs / effective FLOP/s, weight bytes / effective bandwidth),
                 plus the LM head for the rows that sample; GEMM efficiency saturates in the step's
                 token count M: eff(M) = matmul * M / (M + half), half = matmul_half_tokens scaled by
                 the GPU's SMs / CUs over an H100's 132 (a chip with fewer runs fewer tiles at once and
                 fills at fewer rows); plus each row's trips through HBM in the kernels between the GEMMs
                 (residual-add + RMS norms, rotary, gated activation) at the weights' bandwidth
  attention:     max(score FLOPs, quadratic in chunk and context, / effective FLOP/s,
                 KV bytes read and written / effective bandwidth) -- prefill is compute-bound,
                 decode memory-bound, one fused kernel for both as in vLLM's varlen attention;
                 its efficiency saturates in M the same way (attention_half_tokens)
  communication: two all-reduces of the step's hidden states per layer, alpha-beta: a latency per
                 call on the link plus the ring's 2(tp-1)/tp of the bytes over its bandwidth
  overhead:      CPU work: a fixed cost per step, one per scheduled request and one per token, spread
                 over the decode steps one scheduling pass plans (multi-step scheduling); kernel
                 launches per layer unless a CUDA graph replays a decode step; plus one per request
                 scheduled for the first time (its arrival: a CPU profile's HTTP handling)
A step of requests whose prompt KV arrived from a prefill instance runs only the LM head (vLLM's KV
connector bypasses the model's forward for them).
Samples a dummy token that never stops a request, so outputs run to max_tokens (like ignore_eos).
The API server's own work per request (HTTP, tokenization, detokenization: api_*_overhead_s) runs in
another process and does not slow steps; the simulator adds it to each request's timestamps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.executor.efficiency import CUDA_GRAPH_MAX_BATCH_SIZE, Efficiency, matmul_half_tokens
from servelab.specs import DTYPE_BYTES, QUANTIZATION_BYTES, DeviceSpec, ModelSpec, activation_dtype, kv_dtype


class CostModel:
    def __init__(self, model: ModelSpec, device: DeviceSpec, efficiency: Efficiency,
                 tensor_parallel_size: int = 1, dtype: str = "bfloat16", cuda_graphs: bool = True,
                 num_scheduler_steps: int = 1, quantization: str | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        tp = tensor_parallel_size
        # A measured CPU profile: the tp ranks are processes sharing the profiled cores, so a step costs
        # the whole model's compute on them (priced as tp 1) plus the measured all-reduces.
        self.all_reduce = efficiency.all_reduce_fit(tp) if efficiency.layers_curve is not None and tp != 1 else None
        if efficiency.layers_curve is not None and tp != 1 and self.all_reduce is None:
            raise ValueError(f"the measured device profile has no all-reduce timing for tp {tp}; "
                             "run `servelab lab profile` again")
        shard = 1 if efficiency.layers_curve is not None else tp
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}")
        self.model, self.device, self.efficiency, self.tp, self.dtype = model, device, efficiency, tp, dtype
        self.cuda_graphs, self.num_scheduler_steps = cuda_graphs, num_scheduler_steps
        m = model
        self.num_layers = m.num_hidden_layers
        # decoder GEMMs run at the checkpoint's precision where the chip has the units (fp8 W8A8 on
        # Hopper/Ada/CDNA3, fp4 on Blackwell); the LM head stays in the activations' dtype
        self.flops = device.gemm_flops(dtype if quantization is None else "bfloat16") * efficiency.matmul
        self.lm_head_flops = device.flops * efficiency.matmul
        kv = kv_dtype(dtype, kv_cache_dtype)
        # FlashAttention-3's fp8 path runs QK^T and PV in fp8 when the KV cache is fp8 (Shah et al. 2024)
        self.attention_flops = device.gemm_flops(kv) * efficiency.attention
        # no kernel streams faster than a STREAM-like copy (the GPU's memory_ceiling)
        ceiling = device.memory_ceiling or float("inf")
        self.bandwidth = device.memory_bandwidth * min(efficiency.memory, ceiling)
        self.kv_bandwidth = device.memory_bandwidth * min(efficiency.kv_memory, ceiling)
        self.matmul_half_tokens = matmul_half_tokens(efficiency, device)
        # Per GPU and layer: matmul weights (dense part, one expert; and the LM head), KV bytes per token,
        # FLOPs per (query, key) pair.
        self.dense_params = m.dense_params_per_layer / shard
        self.expert_params = m.expert_params / shard
        self.lm_head_params = m.lm_head_params / shard
        activations = activation_dtype(dtype)
        self.dtype_bytes = DTYPE_BYTES[activations]  # the LM head's weights
        # decoder GEMMs stream quantized weights (dequantized in the kernel) or the low-precision dtype's
        self.layer_weight_bytes = QUANTIZATION_BYTES[quantization] if quantization else DTYPE_BYTES[dtype]
        self.kv_bytes_per_token_layer = m.layer_kv_bytes_per_token(kv, shard)
        self.score_flops_per_pair = m.layer_score_flops_per_pair(shard)
        self.hidden_bytes_per_token = m.hidden_bytes_per_token(activations)
        # activations stay in dtype under weight-only quantization
        self.elementwise_bytes_per_token = m.layer_elementwise_bytes_per_token(activations, shard)
        if device.compute_units:
            # The ramp never charges more rows than the roofline: at one row its compute may equal, not exceed,
            # the weight stream. A GEMM of M rows pads them to one tile and streams every weight once; the
            # tile's math hides behind the stream up to the ridge point (peak share x bytes / bandwidth).
            ridge = self.flops * self.layer_weight_bytes / (2 * self.bandwidth)
            self.matmul_half_tokens = min(self.matmul_half_tokens, ridge)
        self._decode_fixed_cache: dict[int, tuple[float, float, float]] = {}

    # ---- components, in seconds per step
    def weights_time(self, num_tokens: int, num_sampled: int) -> float:
        e = self.efficiency
        if e.layers_curve is not None:  # a measured profile: both curves
            return e.layers_curve(num_tokens) + (e.lm_head_curve(num_sampled) if num_sampled else 0.0)  # type: ignore[misc]
        m, k = self.model, self.model.num_experts_per_tok
        experts_read: Any  # 1 (an int) for a dense model, as before: compiled, a float would be converted
        if m.num_experts > 1:  # expected experts touched when num_tokens tokens each pick k of E at random
            experts_read = m.num_experts * (1 - (1 - k / m.num_experts) ** num_tokens)
        else:
            experts_read = 1
        # FLOPs over peak * eff(M), eff(M) = matmul * M / (M + half): M's rows cost as if there were M + half
        half = self.matmul_half_tokens
        layer_flops = 2 * (num_tokens + half) * (self.dense_params + k * self.expert_params)
        layer_bytes = (self.dense_params + experts_read * self.expert_params) * self.layer_weight_bytes
        # the norms, rotary and gated activation between the GEMMs stream the step's rows through HBM
        elementwise = num_tokens * self.elementwise_bytes_per_token / self.bandwidth
        layers = self.num_layers * (_max(layer_flops / self.flops, layer_bytes / self.bandwidth) + elementwise)
        if num_sampled == 0:
            return layers
        return layers + self.lm_head_time(num_sampled)

    def lm_head_time(self, num_sampled: int) -> float:
        e = self.efficiency
        if e.lm_head_curve is not None:
            return e.lm_head_curve(num_sampled)
        return _max(2 * (num_sampled + self.matmul_half_tokens) * self.lm_head_params / self.lm_head_flops,
                    self.lm_head_params * self.dtype_bytes / self.bandwidth)

    def received_step_time(self, num_requests: int) -> dict[str, float]:
        """A step of requests whose prompt KV and last hidden state arrived from a prefill instance, each
        sampling its next token: vLLM's KV connector (simple_connector's recv_kv_caches_and_hidden_states)
        writes the received KV into the paged cache and returns bypass_model_exec, so no decoder layer runs
        and no layer's kernels launch; the LM head turns the received hidden states into logits. The
        transfer itself is priced where it lands (lab/sim/simulate.py)."""
        e = self.efficiency
        cpu = e.step_overhead_s + (e.request_overhead_s + e.token_overhead_s) * num_requests
        overhead = cpu if e.overhead_curve is None else cpu + e.overhead_curve(num_requests)
        parts = {"weights": self.lm_head_time(num_requests), "attention": 0.0, "communication": 0.0,
                 "overhead": overhead}
        parts["total"] = parts["weights"] + parts["overhead"]
        return parts

    def effective_attention_flops(self, num_tokens: int) -> float:
        """Attention kernels' FLOP/s at a step of num_tokens query tokens (saturating in num_tokens)."""
        half = self.efficiency.attention_half_tokens
        return self.attention_flops if not half else self.attention_flops * num_tokens / (num_tokens + half)

    def attention_time(self, num_pairs, num_kv_tokens, num_tokens: int, maximum=None):
        """num_pairs: (query, key) pairs scored; num_kv_tokens: KV entries read plus written; num_tokens:
        query tokens of the step. Scalars, or numpy arrays over steps with maximum=np.maximum (same
        expression, same rounding)."""
        if maximum is None:
            maximum = _max
        return self.num_layers * maximum(self.score_flops_per_pair * num_pairs / self.effective_attention_flops(num_tokens),
                                         self.kv_bytes_per_token_layer * num_kv_tokens / self.kv_bandwidth)

    def communication_time(self, num_tokens: int) -> float:
        tp = self.tp
        if tp == 1:
            return 0.0
        if self.all_reduce is not None:  # measured: two per layer and the vocab-parallel embedding's
            return (2 * self.num_layers + 1) * self.all_reduce.seconds(num_tokens * self.hidden_bytes_per_token)
        e = self.efficiency
        link = self.device.interconnect_bandwidth_per_direction * e.interconnect
        # alpha-beta: a latency per call, then the ring's 2(tp-1) steps each moving 1/tp of the message
        one_all_reduce = e.allreduce_latency_s + 2 * (tp - 1) * num_tokens * self.hidden_bytes_per_token / tp / link
        return self.num_layers * 2 * one_all_reduce

    def overhead_time(self, num_requests: int, num_tokens: int, num_spec_tokens: int = 0) -> float:
        """A step of decodes only, each with its speculative drafts (num_spec_tokens over the step), replays a
        CUDA graph: vLLM V1 captures uniform decode batches of 1 + K query tokens too."""
        e = self.efficiency
        cpu = e.step_overhead_s + e.request_overhead_s * num_requests
        if e.token_overhead_s:
            cpu += e.token_overhead_s * num_tokens
        decode_only = num_tokens - num_spec_tokens == num_requests
        if decode_only and self.num_scheduler_steps > 1:  # one scheduling pass plans that many decode steps
            cpu /= self.num_scheduler_steps
        if e.layer_launch_overhead_s and not (
                self.cuda_graphs and decode_only and num_requests <= CUDA_GRAPH_MAX_BATCH_SIZE):
            cpu += e.layer_launch_overhead_s * self.num_layers
        return cpu if e.overhead_curve is None else cpu + e.overhead_curve(num_requests)

    def step_time(self, num_tokens: int, num_sampled: int, num_requests: int, num_pairs: Any,
                  num_kv_tokens: Any, num_arrivals: int = 0, num_spec_tokens: int = 0) -> dict[str, float]:
        parts = {
            "weights": self.weights_time(num_tokens, num_sampled),
            "attention": self.attention_time(num_pairs, num_kv_tokens, num_tokens),
            "communication": self.communication_time(num_tokens),
            "overhead": (self.overhead_time(num_requests, num_tokens, num_spec_tokens)
                         + num_arrivals * self.efficiency.arrival_overhead_s),
        }
        parts["total"] = parts["weights"] + parts["attention"] + parts["communication"] + parts["overhead"]
        return parts

    def price(self, totals: StepTotals) -> dict[str, float]:
        """step_time() of a StepPlan's totals (plan_totals)."""
        t = totals
        return self.step_time(t.num_tokens, t.num_sampled, t.num_requests, t.num_pairs, t.num_kv_tokens, t.num_arrivals,
                              t.num_spec_tokens)

    def decode_step_times(self, batch_size: int, context_len_sum: int, num_steps: int,
                          within: float = float("inf")) -> list[float]:
        """Durations of consecutive decode steps of a fixed batch whose context lengths sum to
        context_len_sum in the first step (growing by batch_size per step), each equal to step_time()
        of that step: num_steps of them, or fewer when fewer can start within `within` seconds."""
        weights, communication, overhead = self._decode_fixed(batch_size)
        layers, score, attention_flops = self.num_layers, self.score_flops_per_pair, self.effective_attention_flops(batch_size)
        kv, kv_bandwidth = self.kv_bytes_per_token_layer, self.kv_bandwidth
        c = context_len_sum
        first = weights + layers * _max(score * c / attention_flops, kv * (c + batch_size) / kv_bandwidth) \
            + communication + overhead
        if within < first * num_steps:  # steps only grow longer, so at most this many start in time
            num_steps = _fit(num_steps, within, first)
        stop = context_len_sum + batch_size * num_steps
        last = stop - batch_size
        # Both sides of attention's max() are linear in the context, so when reading KV wins clearly at
        # both ends it wins at every step, and max() returns that side exactly.
        memory_bound = (kv * (context_len_sum + batch_size) / kv_bandwidth > 1.01 * (score * context_len_sum / attention_flops)
                        and kv * (last + batch_size) / kv_bandwidth > 1.01 * (score * last / attention_flops))
        # attention_time() and step_time()'s sum, inlined: the same operations in the same order, so
        # each duration is bit-identical to pricing that step's StepPlan
        if num_steps <= 20:  # numpy's per-call cost exceeds the work for short runs
            if memory_bound:
                return [weights + layers * (kv * (c + batch_size) / kv_bandwidth) + communication + overhead
                        for c in range(context_len_sum, stop, batch_size)]
            return [weights + layers * _max(score * c / attention_flops, kv * (c + batch_size) / kv_bandwidth)
                    + communication + overhead for c in range(context_len_sum, stop, batch_size)]
        if memory_bound:  # kv * (c + batch_size) for each step's c: exact integers, as in Python
            attention = np.arange(kv * (context_len_sum + batch_size), kv * (stop + batch_size), kv * batch_size,
                                  dtype=np.int64) / kv_bandwidth
        else:
            contexts: Any = np.arange(context_len_sum, stop, batch_size, dtype=np.int64)
            attention = np.maximum(score * contexts / attention_flops, kv * (contexts + batch_size) / kv_bandwidth)
        attention *= layers
        attention += weights  # weights + attention (addition commutes exactly)
        if communication:  # adding 0.0 changes nothing
            attention += communication
        attention += overhead
        return attention.tolist()

    def _decode_fixed(self, batch_size: int) -> tuple[float, float, float]:
        fixed = self._decode_fixed_cache.get(batch_size)
        if fixed is None:
            fixed = (self.weights_time(batch_size, batch_size), self.communication_time(batch_size),
                     self.overhead_time(batch_size, batch_size))
            self._decode_fixed_cache[batch_size] = fixed
        return fixed

    def decode_breakdown(self, batch_size: int) -> dict[str, float]:
        """The parts of a decode step of batch_size that do not depend on context length."""
        weights, communication, overhead = self._decode_fixed(batch_size)
        return {"weights": weights, "communication": communication, "overhead": overhead}

    def decode_step_time(self, batch_size: int, context_len: float) -> float:
        """One decode step of batch_size requests at context_len tokens each (capacity estimates)."""
        s = batch_size * context_len
        return self.step_time(batch_size, batch_size, batch_size, s, s + batch_size)["total"]


@dataclass(slots=True)
class StepTotals:
    """What the cost model prices a StepPlan by."""
    num_tokens: int
    num_sampled: int  # rows through the LM head
    num_requests: int
    num_pairs: int  # (query, key) pairs scored
    num_kv_tokens: int  # KV entries read plus written
    num_arrivals: int
    num_spec_tokens: int = 0  # speculative draft tokens verified (in num_tokens too)


def _max(a: float, b: float) -> float:
    """max(a, b), the same float: Python 3.11's builtin max() parses its arguments on every call, which
    costs more than the comparison at every priced step."""
    return b if b > a else a


def _fit(num_steps: int, within: float, first: float) -> int:
    """max(1, min(num_steps, int(within / first) + 1)): the steps that can start within `within`
    seconds when none is shorter than first, at least one."""
    fits = int(within / first) + 1
    if num_steps < fits:
        fits = num_steps
    return fits if fits > 1 else 1


def _received(s: ScheduledRequest) -> bool:
    """First scheduled here with its whole prompt's KV already present: handed over by a prefill instance
    (a prefix-cache hit still computes the prompt's last token; a preempted request starts again from 0)."""
    prompt = s.prompt_token_ids
    return prompt is not None and s.num_computed_tokens >= len(prompt) and s.sample


def plan_totals(plan: StepPlan) -> StepTotals:
    """The executor's step arithmetic, also what calibration fits measured steps by."""
    return StepTotals(*_plan_sums(plan))


def _plan_sums(plan: StepPlan) -> tuple[int, int, int, int, int, int, int]:
    """StepTotals' fields, in order (a tuple: no object to build at every priced step)."""
    num_tokens = num_sampled = num_pairs = num_kv_tokens = num_arrivals = num_spec_tokens = 0
    for s in plan.scheduled:
        n = len(s.token_ids)
        computed = s.num_computed_tokens
        context = computed + n
        num_tokens += n
        # new tokens at positions context-n+1 .. context attend causally
        num_pairs += n * context - n * (n - 1) // 2
        num_kv_tokens += context + n
        if s.sample:  # speculative drafts: the LM head runs after the last sampled token and after each draft
            num_sampled += 1 + s.num_spec_tokens
            num_spec_tokens += s.num_spec_tokens
        # the executor's first sight of a request that has no output yet: a new request, from its first token or
        # from its prefix-cache hit (or one preempted by recompute, which pays again; preemption is rare enough not
        # to matter). One handed over with outputs (a remote prefill's first token) arrived elsewhere.
        if s.prompt_token_ids is not None and (computed == 0 or not s.output_token_ids):
            num_arrivals += 1
    return num_tokens, num_sampled, len(plan.scheduled), num_pairs, num_kv_tokens, num_arrivals, num_spec_tokens
