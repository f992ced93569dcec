"""Every Prometheus metric the server exports: vLLM's names and meanings under `servelab:`, plus
servelab's own meters. One registry per server so tests can run several in one process."""
from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from servelab.metrics.events import EngineState, FinishedRequest, KVTransferSample, StepSample

PREFIX = "servelab:"
# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KV_TRANSFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                               10.0)
KV_TRANSFER_BYTES_BUCKETS = tuple(2 ** e for e in range(16, 33, 2))  # 64 KiB .. 4 GiB
FINISHED_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_value: 1, 2, 5, 10, 20, 50, ..."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


def weight_bytes_by_device(weight_bytes: int | Sequence[int], device: str) -> dict[str, int]:
    """One series per tensor-parallel rank (device "cpu:0", "cpu:1", ...); a single device keeps its name."""
    if isinstance(weight_bytes, int):
        return {device: weight_bytes}
    if len(weight_bytes) == 1:
        return {device: weight_bytes[0]}
    return {f"{device}:{rank}": value for rank, value in enumerate(weight_bytes)}


class ServerMetrics:
    """The engine's own series (its gauges, the token and preemption counters, tokens per step) carry an
    `engine` label, the data-parallel core's index, as vLLM's do: sum over it for the server's totals."""

    def __init__(self, model_name: str, weight_bytes: int | Sequence[int], max_model_len: int = 8192, device: str = "cpu",
                 registry: CollectorRegistry | None = None, num_engines: int = 1) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        engine = ("engine",)

        def gauge(name, doc, extra=()):
            return Gauge(PREFIX + name, doc, labels + list(extra), registry=r)

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets, extra=()):
            return Histogram(PREFIX + name, doc, labels + list(extra), buckets=buckets, registry=r)

        # ---- vLLM's names
        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.",
                                          engine)
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                                          engine)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine)
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.", engine)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", engine)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                         engine)
        # speculative decoding: series appear once an engine reports that it speculates
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.", engine)
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.", engine)
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens.", engine)
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", engine + ("position",))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.", engine)
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.", engine)
        self.request_success = counter("request_success", "Count of successfully processed requests.",
                                       ["finished_reason"])
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        # vLLM's meanings: time_per_output_token_seconds is per token (the older name of
        # inter_token_latency_seconds); request_time_per_output_token_seconds is each request's TPOT.
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.", TPOT_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            TPOT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", TPOT_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of end to end request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent waiting to be scheduled, in seconds.",
                                            REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets(max_model_len))
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets(max_model_len))
        self.iteration_tokens = histogram("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS, engine)
        # ---- servelab's own meters
        self.batch_slot_saturation = gauge("batch_slot_saturation",
                                           "Running requests over max_num_seqs (1 = every batch slot taken).", engine)
        self.kv_cache_reserved_unused_slots = gauge(
            "kv_cache_reserved_unused_slots",
            "Token slots held in KV blocks but not filled (the waste of contiguous reservation, static stages).",
            engine)
        self.kv_cache_reserved_unused_perc = gauge("kv_cache_reserved_unused_perc",
                                                   "Reserved-but-unused token slots over the whole KV pool.", engine)
        self.kv_cache_num_blocks = gauge("kv_cache_num_blocks", "KV cache pool size in blocks.", engine)
        self.kv_cache_num_free_blocks = gauge("kv_cache_num_free_blocks", "Free KV cache blocks.", engine)
        self.weight_bytes = gauge("weight_bytes", "Model weight bytes held per device.", ["device"])
        self.quantization_info = gauge("quantization_info",
                                       "The weights' and KV cache's quantization the engine runs, and why (value 1).",
                                       ["mode", "kv_cache_dtype", "reason"])
        # disaggregated prefill/decode: labelled by the sending (prefill) engine
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV cache bytes sent to decode instances.", engine)
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV transfers that failed.", engine)
        self.kv_transfer_time = histogram("kv_transfer_time_seconds",
                                          "Histogram of the time one request's KV blocks took to send, in seconds.",
                                          KV_TRANSFER_SECONDS_BUCKETS, engine)
        self.request_kv_transfer_bytes = histogram("request_kv_transfer_bytes",
                                                   "Histogram of the KV bytes sent per request.",
                                                   KV_TRANSFER_BYTES_BUCKETS, engine)
        self.num_requests_queued = gauge("num_requests_queued",
                                         "Requests admitted by the gateway that have no first token yet.")
        self.num_requests_rejected = counter("num_requests_rejected",
                                             "Requests refused at admission (429 queue full, 503 draining).",
                                             ["reason"])

        m = model_name
        # Create every series now so scrapes see them (at 0) before the first request.
        for metric in (self.time_to_first_token, self.time_per_output_token, self.request_time_per_output_token,
                       self.inter_token_latency, self.e2e_request_latency, self.request_queue_time,
                       self.request_prefill_time, self.request_decode_time, self.request_prompt_tokens,
                       self.request_generation_tokens, self.num_requests_queued):
            metric.labels(m)
        engine_metrics = (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                          self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits, self.prompt_tokens, self.generation_tokens,
                          self.iteration_tokens, self.batch_slot_saturation, self.kv_cache_reserved_unused_slots,
                          self.kv_cache_reserved_unused_perc, self.kv_cache_num_blocks, self.kv_cache_num_free_blocks)
        for index in range(num_engines):
            for metric in engine_metrics:
                metric.labels(m, str(index))
        for reason in FINISHED_REASONS:
            self.request_success.labels(m, reason)
        for reason in ("queue_full", "draining"):
            self.num_requests_rejected.labels(m, reason)
        for device_name, value in weight_bytes_by_device(weight_bytes, device).items():
            self.weight_bytes.labels(m, device_name).set(value)
        # (engine index, field of EngineState) -> the running total already added to its counter
        self._totals_seen: dict[tuple[int, str], int] = {}

    def set_quantization(self, mode: str, kv_cache_dtype: str, reason: str) -> None:
        self.quantization_info.labels(self.model_name, mode, kv_cache_dtype, reason).set(1)

    # ---- recording (called from the metrics recorder thread, never the engine's)
    def record_state(self, s: EngineState, engine_index: int = 0) -> None:
        labels = (self.model_name, str(engine_index))
        self.num_requests_running.labels(*labels).set(s.num_running)
        self.num_requests_waiting.labels(*labels).set(s.num_waiting)
        self.kv_cache_usage_perc.labels(*labels).set(s.kv_usage)
        self.kv_cache_num_blocks.labels(*labels).set(s.num_blocks)
        self.kv_cache_num_free_blocks.labels(*labels).set(s.num_free_blocks)
        self.batch_slot_saturation.labels(*labels).set(s.num_running / s.max_num_seqs)
        self.kv_cache_reserved_unused_slots.labels(*labels).set(s.num_reserved_unused_slots)
        self.kv_cache_reserved_unused_perc.labels(*labels).set(
            s.num_reserved_unused_slots / (s.num_blocks * s.block_size))
        totals = [(self.num_preemptions, "num_preemptions_total"),
                  (self.prefix_cache_queries, "prefix_cache_queries_total"),
                  (self.prefix_cache_hits, "prefix_cache_hits_total")]
        if s.spec_num_accepted_tokens_per_pos:
            totals += [(self.spec_decode_num_drafts, "spec_num_drafts_total"),
                       (self.spec_decode_num_draft_tokens, "spec_num_draft_tokens_total"),
                       (self.spec_decode_num_accepted_tokens, "spec_num_accepted_tokens_total")]
        for counter, total_name in totals:
            self._add_total(counter, labels, getattr(s, total_name), (engine_index, total_name))
        for position, total in enumerate(s.spec_num_accepted_tokens_per_pos):
            self._add_total(self.spec_decode_num_accepted_tokens_per_pos, (*labels, str(position)), total,
                            (engine_index, f"spec_num_accepted_tokens_per_pos/{position}"))

    def _add_total(self, counter: Counter, labels: tuple[str, ...], total: int, key: tuple[int, str]) -> None:
        """Bring a counter's series up to an engine's running total (created at 0 on first sight)."""
        series = counter.labels(*labels)
        seen = self._totals_seen.get(key, 0)
        if total > seen:
            series.inc(total - seen)
            self._totals_seen[key] = total

    def record_step(self, step: StepSample, engine_index: int = 0) -> None:
        labels = (self.model_name, str(engine_index))
        self.iteration_tokens.labels(*labels).observe(step.num_scheduled_tokens)
        if step.num_prompt_tokens:
            self.prompt_tokens.labels(*labels).inc(step.num_prompt_tokens)
        if step.num_generation_tokens:
            self.generation_tokens.labels(*labels).inc(step.num_generation_tokens)

    def record_finished(self, request: FinishedRequest) -> None:
        m = self.model_name
        for reason in request.finish_reasons:
            self.request_success.labels(m, reason).inc()
        for t in request.timings:
            self.time_to_first_token.labels(m).observe(t.ttft)
            self.e2e_request_latency.labels(m).observe(t.e2el)
            self.request_prompt_tokens.labels(m).observe(t.prompt_len)
            self.request_generation_tokens.labels(m).observe(t.output_len)
            self.request_decode_time.labels(m).observe(t.finished - t.first_token)
            if t.tpot is not None:
                self.request_time_per_output_token.labels(m).observe(t.tpot)
            if t.queue_time is not None:
                self.request_queue_time.labels(m).observe(t.queue_time)
                self.request_prefill_time.labels(m).observe(t.first_token - t.first_scheduled)
            itl, tpot = self.inter_token_latency.labels(m), self.time_per_output_token.labels(m)
            for gap in t.itls:
                itl.observe(gap)
                tpot.observe(gap)

    def record_kv_transfer(self, transfer: KVTransferSample, engine_index: int) -> None:
        labels = (self.model_name, str(engine_index))
        if not transfer.ok:
            self.kv_transfer_failures.labels(*labels).inc()
            return
        self.kv_transfer_bytes.labels(*labels).inc(transfer.num_bytes)
        self.kv_transfer_time.labels(*labels).observe(transfer.seconds)
        self.request_kv_transfer_bytes.labels(*labels).observe(transfer.num_bytes)

    def record_rejected(self, reason: str) -> None:
        self.num_requests_rejected.labels(self.model_name, reason).inc()

    def set_queued(self, num_queued: int) -> None:
        self.num_requests_queued.labels(self.model_name).set(num_queued)
