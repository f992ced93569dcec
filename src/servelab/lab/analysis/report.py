"""Text rendering of a lab evaluation: the meters table and the load generator's metric lines."""
from __future__ import annotations

from servelab.specs import GIB
from servelab.lab.analysis.evaluate import Evaluation

BOTTLENECK = "<- bottleneck"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _target(value: float | None) -> str:
    return f" (target {_ms(value)})" if value else ""


def meter_rows(e: Evaluation) -> list[tuple[str, str, bool]]:
    m = e.meters
    if not e.fits:
        w = m["weights"]
        return [("Weights per GPU", f"{w['bytes_per_gpu'] / GIB:.1f} GiB of {w['memory_bytes'] / GIB:.0f} GiB "
                 f"({w['share_of_memory']:.0%}); KV left: {w['kv_cache_bytes_per_gpu'] / GIB:.2f} GiB", True)]
    kv, w, dec, slots = m["kv_cache"], m["weights"], m["decode_throughput"], m["batch_slots"]
    ttft, tpot, good, pre, queue, step = m["ttft"], m["tpot"], m["goodput"], m["preemptions"], m["queue"], m["step_time"]
    kv_text = f"peak {kv['peak_usage']:.0%} / mean {kv['mean_usage']:.0%} of {kv['num_blocks']:,} blocks"
    if "reserved_unused_share" in kv:
        kv_text += f"; reserved but unused {kv['reserved_unused_share']:.0%}"
    demanded = dec["demanded_tokens_per_s"]
    dec_text = (f"{demanded:,.0f} demanded" if demanded is not None else f"{dec['served_tokens_per_s']:,.0f} served")
    rows = [
        ("KV-cache pressure", kv_text, kv["bottleneck"]),
        ("Weights per GPU", f"{w['bytes_per_gpu'] / GIB:.1f} GiB ({w['share_of_memory']:.0%} of memory)",
         w["bottleneck"]),
        ("Decode throughput", f"{dec_text} of {dec['capacity_tokens_per_s']:,.0f} tok/s capacity "
         f"({dec['utilization']:.0%})", dec["bottleneck"]),
        ("Batch slots", f"mean {slots['mean_running']:.1f} / peak {slots['peak_running']} of "
         f"{slots['max_num_seqs']} running; full with a queue {slots['full_with_waiting_share']:.0%} of the time",
         slots["bottleneck"]),
        ("Time to first token", f"p50 {_ms(ttft['median_ms'])} / p99 {_ms(ttft['p99_ms'])}{_target(ttft['target_ms'])}",
         ttft["bottleneck"]),
        ("Time per output token", f"p50 {_ms(tpot['median_ms'])} / p99 {_ms(tpot['p99_ms'])}{_target(tpot['target_ms'])}",
         tpot["bottleneck"]),
        ("Goodput", f"{good['requests_per_s']:.2f} req/s, {good['slo_attainment']:.1%} of requests meet the SLOs",
         good["bottleneck"]),
        ("Preemptions", f"{pre['count']:,} ({pre['requests_preempted']:,} requests)", pre["bottleneck"]),
        ("Queue", f"mean {queue['mean_waiting']:.1f} / peak {queue['peak_waiting']:,} waiting; "
         f"{queue['mean_queue_ms']:.1f} ms mean wait ({queue['share_of_ttft']:.0%} of TTFT)", queue["bottleneck"]),
        ("Step time", f"{step['mean_step_ms']:.2f} ms mean: weights {step['weights_share']:.0%}, attention "
         f"{step['attention_share']:.0%}, all-reduce {step['communication_share']:.0%}, overhead "
         f"{step['overhead_share']:.0%}", step["bottleneck"]),
    ]
    if "prefix_cache" in m:
        p = m["prefix_cache"]
        rows.append(("Prefix cache", f"{p['hit_rate']:.0%} of {p['queried_tokens']:,} prompt tokens found cached",
                     p["bottleneck"]))
    if "kv_transfer" in m:
        t = m["kv_transfer"]
        rows.append(("KV transfer (P->D)", f"mean {_ms(t['mean_ms'])} / p99 {_ms(t['p99_ms'])} "
                     f"({t['share_of_ttft']:.0%} of TTFT)", t["bottleneck"]))
    return rows


def format_evaluation(e: Evaluation, workload_text: str) -> str:
    lines = [e.deployment.describe(), f"workload: {workload_text}", ""]
    if not e.fits:
        lines.insert(1, f"DOES NOT FIT: {e.reason}")
    width = max(len(name) for name, _, _ in meter_rows(e))
    for name, text, bottleneck in meter_rows(e):
        lines.append(f"{name:<{width}}  {text}{'  ' + BOTTLENECK if bottleneck else ''}")
    if e.fits:
        mt = e.metrics
        lines += ["", f"requests/s {mt['request_throughput']:.2f}   output tok/s {mt['output_throughput']:,.0f}   "
                      f"duration {mt['duration']:.1f} s   completed {mt['completed']:,}"]
        for name in ("ttft", "tpot", "itl", "e2el"):
            lines.append(f"{name.upper():<5} mean {_ms(mt[f'mean_{name}_ms'])}  median {_ms(mt[f'median_{name}_ms'])}  "
                         f"p90 {_ms(mt[f'p90_{name}_ms'])}  p99 {_ms(mt[f'p99_{name}_ms'])}")
    return "\n".join(lines)
