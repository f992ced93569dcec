"""Request statistics, the Prometheus metrics and the recorder's live snapshot."""
import re
import time

from prometheus_client import generate_latest

from servelab.metrics.events import EngineEvents, EngineState, FinishedRequest, StepSample
from servelab.metrics.recorder import MetricsRecorder, with_rates
from servelab.metrics.request_stats import RequestTiming, compute_metrics
from servelab.metrics.server_metrics import ServerMetrics

STATE = EngineState(num_running=2, num_waiting=1, kv_usage=0.25, num_blocks=8, num_free_blocks=6, block_size=4,
                    num_reserved_unused_slots=4, max_num_seqs=4, num_preemptions_total=3)


def timing() -> RequestTiming:
    return RequestTiming(prompt_len=5, output_len=3, arrival=10.0, first_token=10.5, finished=11.5,
                         token_times=(10.5, 11.0, 11.5), first_scheduled=10.2)


def test_request_timing_definitions():
    t = timing()
    assert (t.ttft, t.e2el, t.tpot) == (0.5, 1.5, 0.5)
    assert t.itls == [0.5, 0.5]
    assert abs(t.queue_time - 0.2) < 1e-9
    single = RequestTiming(5, 1, 0.0, 1.0, 1.0, (1.0,))
    assert single.tpot is None and single.itls == []
    m = compute_metrics([t], duration=2.0)
    assert m["mean_ttft_ms"] == 500 and m["mean_tpot_ms"] == 500 and m["mean_itl_ms"] == 500
    assert m["output_throughput"] == 1.5


def scrape(metrics: ServerMetrics) -> dict:
    values = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="m",?', lambda m: "," if m.group().count(",") == 2 else "", name)
            values[name.replace(',engine="0"', "").replace('engine="0"', "").replace("{}", "")] = float(value)
    return values


def test_server_metrics_names_and_values():
    metrics = ServerMetrics("m", weight_bytes=1234)
    before = scrape(metrics)
    assert before["servelab:num_preemptions_total"] == 0 and before["servelab:time_to_first_token_seconds_count"] == 0
    metrics.record_state(STATE)
    metrics.record_step(StepSample(duration=0.01, num_scheduled_tokens=7, num_generation_tokens=2, num_prompt_tokens=5))
    metrics.record_finished(FinishedRequest("r", ["length"], [timing()]))
    metrics.record_rejected("queue_full")
    v = scrape(metrics)
    assert v["servelab:num_requests_running"] == 2 and v["servelab:num_requests_waiting"] == 1
    assert v["servelab:kv_cache_usage_perc"] == 0.25 and v["servelab:num_preemptions_total"] == 3
    assert v["servelab:batch_slot_saturation"] == 0.5
    assert v["servelab:kv_cache_reserved_unused_slots"] == 4 and v["servelab:kv_cache_reserved_unused_perc"] == 0.125
    assert v['servelab:weight_bytes{device="cpu"}'] == 1234
    metrics.set_quantization("int8", "int8", "measured fastest")
    assert scrape(metrics)['servelab:quantization_info{kv_cache_dtype="int8",mode="int8",reason="measured fastest"}'] == 1
    assert v["servelab:prompt_tokens_total"] == 5 and v["servelab:generation_tokens_total"] == 2
    assert v['servelab:request_success_total{finished_reason="length"}'] == 1
    assert v["servelab:time_to_first_token_seconds_sum"] == 0.5
    assert v["servelab:request_time_per_output_token_seconds_sum"] == 0.5
    assert v["servelab:time_per_output_token_seconds_count"] == v["servelab:inter_token_latency_seconds_count"] == 2
    assert v["servelab:request_prompt_tokens_sum"] == 5 and v["servelab:request_generation_tokens_sum"] == 3
    assert abs(v["servelab:request_prefill_time_seconds_sum"] - 0.3) < 1e-9
    assert v["servelab:request_decode_time_seconds_sum"] == 1.0
    assert v["servelab:e2e_request_latency_seconds_sum"] == 1.5
    assert v["servelab:iteration_tokens_total_sum"] == 7
    assert v['servelab:num_requests_rejected_total{reason="queue_full"}'] == 1
    metrics.record_state(STATE)  # the preemption counter follows the engine's total, not each report
    assert scrape(metrics)["servelab:num_preemptions_total"] == 3


def test_recorder_snapshot_and_rates():
    recorder = MetricsRecorder(ServerMetrics("m", weight_bytes=1))
    recorder.start()
    try:
        recorder.submit(EngineEvents(STATE, [StepSample(0.01, 7, 2, 5)], [FinishedRequest("r", ["stop"], [timing()])]))
        deadline = time.monotonic() + 5
        while recorder.snapshot().get("requests_finished_total", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = recorder.snapshot()
    finally:
        recorder.stop()
    assert snap["generation_tokens_total"] == 2 and snap["request_success_total"] == {"stop": 1}
    assert snap["num_requests_running"] == 2 and snap["batch_slot_saturation"] == 0.5
    assert snap["recent"]["completed"] == 1 and snap["recent"]["mean_ttft_ms"] == 500
    rated = with_rates(snap, {**snap, "generation_tokens_total": 0}, 2.0)
    assert rated["generation_tokens_per_s"] == 1.0
    assert with_rates(snap, None, 1.0)["generation_tokens_per_s"] == 0.0


def test_engine_label_per_core_and_the_snapshot_sums_them():
    metrics = ServerMetrics("m", weight_bytes=1, num_engines=2)
    recorder = MetricsRecorder(metrics)
    other = EngineState(num_running=1, num_waiting=0, kv_usage=0.5, num_blocks=8, num_free_blocks=4, block_size=4,
                        num_reserved_unused_slots=0, max_num_seqs=4, num_preemptions_total=1)
    recorder.start()
    recorder.submit(EngineEvents(STATE, [StepSample(0.01, 7, 2, 5)], engine_index=0))
    recorder.submit(EngineEvents(other, [StepSample(0.01, 3, 1, 0)], engine_index=1))
    recorder.stop()  # records what was submitted, then stops
    text = generate_latest(metrics.registry).decode()
    assert 'servelab:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'servelab:num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert 'servelab:generation_tokens_total{engine="1",model_name="m"} 1.0' in text
    assert 'servelab:num_preemptions_total{engine="0",model_name="m"} 3.0' in text
    snap = recorder.snapshot()
    assert (snap["num_requests_running"], snap["num_requests_waiting"], snap["generation_tokens_total"]) == (3, 1, 3)
    assert (snap["kv_cache_num_blocks"], snap["kv_cache_num_free_blocks"], snap["kv_cache_usage_perc"]) == (16, 10, 6 / 16)
    assert snap["max_num_seqs"] == 8 and snap["num_preemptions_total"] == 4


def test_prefix_cache_counters_add_what_each_engine_reports():
    metrics = ServerMetrics("m", weight_bytes=1, num_engines=2)
    assert scrape(metrics)["servelab:prefix_cache_queries_total"] == 0
    for queries, hits in ((100, 0), (250, 96)):
        metrics.record_state(EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0, queries, hits), engine_index=0)
    metrics.record_state(EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0, 10, 5), engine_index=1)
    text = generate_latest(metrics.registry).decode()
    assert 'servelab:prefix_cache_queries_total{engine="0",model_name="m"} 250.0' in text
    assert 'servelab:prefix_cache_hits_total{engine="0",model_name="m"} 96.0' in text
    assert 'servelab:prefix_cache_hits_total{engine="1",model_name="m"} 5.0' in text


def test_spec_decode_counters_with_vllm_names():
    metrics = ServerMetrics("m", weight_bytes=1)
    metrics.record_state(STATE)  # an engine that does not speculate: no series
    assert not [name for name in scrape(metrics) if "spec_decode" in name]
    spec = dict(spec_num_drafts_total=4, spec_num_draft_tokens_total=12, spec_num_accepted_tokens_total=7,
                spec_num_accepted_tokens_per_pos=(4, 2, 1))
    metrics.record_state(EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0, **spec))
    later = dict(spec, spec_num_drafts_total=5, spec_num_accepted_tokens_per_pos=(5, 2, 1))
    metrics.record_state(EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0, **later))
    v = scrape(metrics)
    assert (v["servelab:spec_decode_num_drafts_total"], v["servelab:spec_decode_num_draft_tokens_total"],
            v["servelab:spec_decode_num_accepted_tokens_total"]) == (5, 12, 7)
    per_pos = {name: value for name, value in v.items() if name.startswith("servelab:spec_decode_num_accepted_tokens_per_pos_total")}
    assert [per_pos[name] for name in sorted(per_pos)] == [5, 2, 1] and all('position="' in name for name in per_pos)
