"""The metrics recorder thread: takes EngineEvents from the engine cores' output tasks through a queue and
updates Prometheus and the live snapshot, so no metric bookkeeping happens inside an engine step."""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from servelab.metrics.events import EngineEvents, EngineState
from servelab.metrics.request_stats import RequestTiming, compute_metrics
from servelab.metrics.server_metrics import ServerMetrics

logger = logging.getLogger(__name__)

# Latency summaries in the live snapshot cover the requests finished in this many seconds.
RECENT_WINDOW_S = 60.0
RECENT_MAX_REQUESTS = 1024


class MetricsRecorder:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self._events: queue.SimpleQueue[EngineEvents | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._states: dict[int, EngineState] = {}  # per engine core
        self._totals = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished_total": 0,
                        "num_steps_total": 0}
        self._finish_reasons: collections.Counter[str] = collections.Counter()
        self._recent: collections.deque[tuple[float, RequestTiming]] = collections.deque(maxlen=RECENT_MAX_REQUESTS)
        self._thread = threading.Thread(target=self._run, name="servelab-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._events.put(None)
        self._thread.join(timeout=5)

    def submit(self, events: EngineEvents) -> None:
        """Any thread; never blocks."""
        self._events.put(events)

    def _run(self) -> None:
        while True:
            events = self._events.get()
            if events is None:
                return
            try:
                self._record(events)
            except Exception:  # a metrics bug must not take serving down
                logger.exception("recording metrics failed")

    def _record(self, events: EngineEvents) -> None:
        m = self.metrics
        m.record_state(events.state, events.engine_index)
        for step in events.steps:
            m.record_step(step, events.engine_index)
        for request in events.finished:
            m.record_finished(request)
        for transfer in events.kv_transfers:
            m.record_kv_transfer(transfer, events.engine_index)
        now = time.monotonic()
        with self._lock:
            self._states[events.engine_index] = events.state
            for step in events.steps:
                self._totals["num_steps_total"] += 1
                self._totals["prompt_tokens_total"] += step.num_prompt_tokens
                self._totals["generation_tokens_total"] += step.num_generation_tokens
            for request in events.finished:
                self._totals["requests_finished_total"] += 1
                self._finish_reasons.update(request.finish_reasons)
                self._recent.extend((now, t) for t in request.timings)

    def snapshot(self) -> dict:
        """The live meters as plain JSON-able numbers (the /v1/metrics/stream payload, less rates)."""
        now = time.monotonic()
        with self._lock:
            state = _total(list(self._states.values()))
            totals = dict(self._totals)
            reasons = dict(self._finish_reasons)
            while self._recent and now - self._recent[0][0] > RECENT_WINDOW_S:
                self._recent.popleft()
            recent = [t for _, t in self._recent]
        snap: dict = {"model": self.metrics.model_name, **totals, "request_success_total": reasons}
        if state is not None:
            snap.update(
                num_requests_running=state.num_running,
                num_requests_waiting=state.num_waiting,
                kv_cache_usage_perc=state.kv_usage,
                kv_cache_num_blocks=state.num_blocks,
                kv_cache_num_free_blocks=state.num_free_blocks,
                kv_cache_reserved_unused_slots=state.num_reserved_unused_slots,
                batch_slot_saturation=state.num_running / state.max_num_seqs,
                max_num_seqs=state.max_num_seqs,
                num_preemptions_total=state.num_preemptions_total,
                prefix_cache_queries_total=state.prefix_cache_queries_total,
                prefix_cache_hits_total=state.prefix_cache_hits_total,
            )
        summary = compute_metrics(recent, RECENT_WINDOW_S)
        snap["recent"] = {"window_s": RECENT_WINDOW_S, "completed": summary["completed"],
                          **{k: v for k, v in summary.items() if k.endswith("_ms")}}
        return snap


def _total(states: list[EngineState]) -> EngineState | None:
    """The data-parallel cores as one engine: counts and blocks add up, usage is over the pooled blocks."""
    if len(states) <= 1:
        return states[0] if states else None
    num_blocks = sum(s.num_blocks for s in states)
    num_free_blocks = sum(s.num_free_blocks for s in states)
    return EngineState(sum(s.num_running for s in states), sum(s.num_waiting for s in states),
                       (num_blocks - num_free_blocks) / num_blocks, num_blocks, num_free_blocks, states[0].block_size,
                       sum(s.num_reserved_unused_slots for s in states), sum(s.max_num_seqs for s in states),
                       sum(s.num_preemptions_total for s in states),
                       sum(s.prefix_cache_queries_total for s in states), sum(s.prefix_cache_hits_total for s in states),
                       sum(s.spec_num_drafts_total for s in states), sum(s.spec_num_draft_tokens_total for s in states),
                       sum(s.spec_num_accepted_tokens_total for s in states),
                       tuple(map(sum, zip(*(s.spec_num_accepted_tokens_per_pos for s in states)))))


def with_rates(current: dict, previous: dict | None, interval_s: float) -> dict:
    """Adds per-second rates of the token and request counters since the previous snapshot."""
    out = dict(current)
    for key, rate_key in (("generation_tokens_total", "generation_tokens_per_s"),
                          ("prompt_tokens_total", "prompt_tokens_per_s"),
                          ("requests_finished_total", "requests_per_s")):
        delta = current[key] - previous[key] if previous else 0
        out[rate_key] = delta / interval_s if previous and interval_s > 0 else 0.0
    return out
