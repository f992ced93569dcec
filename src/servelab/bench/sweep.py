"""`servelab bench sweep`: `bench serve` at several request rates, latency and throughput against rate.

Either a list (--request-rates 1,2,4,8) or a search (--search) for the highest rate at which the share
of requests meeting every --goodput SLO stays at or above --goodput-target: the rate doubles from
--min-rate until the share drops (or --max-rate is reached), then --search-steps bisections narrow it.
Every point sends the same seeded requests (the lengths do not depend on the rate), only the
arrival gaps scale.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from typing import Callable

from servelab.bench.datasets import load_tokenizer
from servelab.bench.serve import (add_output_args, add_request_args, add_workload_args, client_from_args,
                                  parse_goodput, requests_from_args, run_benchmark)

PER_REQUEST_KEYS = ("start_times", "input_lens", "output_lens", "ttfts", "e2els", "itls", "errors")


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="bench serve at several request rates (or search the highest that meets SLOs)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model name for the API (default: the first on /v1/models)")
    p.add_argument("--request-rates", default=None, help="comma-separated requests/s, e.g. 1,2,4,8 (inf allowed)")
    p.add_argument("--search", action="store_true", help="search the highest rate meeting --goodput-target")
    p.add_argument("--goodput-target", type=float, default=0.9, help="share of requests meeting every SLO")
    p.add_argument("--min-rate", type=float, default=0.5)
    p.add_argument("--max-rate", type=float, default=64.0)
    p.add_argument("--search-steps", type=int, default=3, help="bisections after the doubling phase")
    add_workload_args(p, num_prompts=200, with_rate=False)
    add_request_args(p)
    add_output_args(p)
    p.set_defaults(func=run)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--request-rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--request-rates must be positive numbers (or inf), got {text!r}")
    return rates


def search_highest_rate(share_at: Callable[[float], float], target: float, min_rate: float, max_rate: float,
                        steps: int) -> float | None:
    """The highest rate found with share_at(rate) >= target, or None if even min_rate misses it."""
    good, bad, rate = None, None, min_rate
    while True:
        if share_at(rate) >= target:
            good = rate
            if rate >= max_rate:
                return good
            rate = min(2 * rate, max_rate)
        else:
            bad = rate
            break
    if good is None:
        return None
    for _ in range(steps):
        mid = (good + bad) / 2
        if share_at(mid) >= target:
            good = mid
        else:
            bad = mid
    return good


def _check(args: argparse.Namespace, slos: dict) -> None:
    if args.search == (args.request_rates is not None):
        raise ValueError("give either --request-rates or --search")
    if args.search:
        if not slos:
            raise ValueError("--search needs --goodput SLOs, e.g. --goodput ttft:1000 tpot:100")
        if not 0 < args.goodput_target <= 1:
            raise ValueError(f"--goodput-target must be in (0, 1], got {args.goodput_target}")
        if not 0 < args.min_rate <= args.max_rate or math.isinf(args.max_rate):
            raise ValueError("need 0 < --min-rate <= --max-rate < inf")


def point_row(point: dict) -> dict:
    row = {"req/s offered": point["request_rate"], "completed": point["completed"], "failed": point["failed"],
           "req/s": point["request_throughput"], "output tok/s": point["output_throughput"],
           "TTFT p50 ms": point["median_ttft_ms"], "TTFT p99 ms": point["p99_ttft_ms"],
           "TPOT p50 ms": point["median_tpot_ms"], "TPOT p99 ms": point["p99_tpot_ms"]}
    if "goodput_share" in point:
        row["goodput share"] = point["goodput_share"]
    return row


def run(args: argparse.Namespace) -> int:
    from servelab.bench.report import plot_against
    from servelab.bench.results import markdown_table, write_results

    slos = parse_goodput(args.goodput)
    _check(args, slos)
    tokenizer = load_tokenizer(args.tokenizer)
    client = client_from_args(args, args.base_url, args.api_key, args.model)
    points: list[dict] = []

    def measure(rate: float) -> float:
        result = run_benchmark(client, requests_from_args(args, tokenizer, rate), tokenizer, args.max_concurrency,
                               slos, not args.disable_tqdm, desc=f"{rate:g} req/s")
        point = {"request_rate": rate, **{k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}}
        points.append(point)
        print(f"{rate:g} req/s: {point['output_throughput']:,.1f} output tok/s, p99 TTFT {point['p99_ttft_ms']:,.0f} "
              f"ms" + (f", goodput share {point['goodput_share']:.1%}" if slos else ""), flush=True)
        return point.get("goodput_share", 1.0)

    best = None
    if args.search:
        best = search_highest_rate(measure, args.goodput_target, args.min_rate, args.max_rate, args.search_steps)
    else:
        for rate in parse_rates(args.request_rates):
            measure(rate)
    points.sort(key=lambda p: p["request_rate"])
    name = args.name or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = args.result_dir / name
    rows = [point_row(p) for p in points]
    payload = {"model_id": client.model, "base_url": client.base_url, "endpoint": client.endpoint,
               "goodput_slos_ms": slos, "goodput_target": args.goodput_target if args.search else None,
               "best_request_rate": best, "points": [{**p, "request_rate": _json_rate(p["request_rate"])}
                                                     for p in points],
               "command": "servelab " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    json_path, _ = write_results(name, payload, rows, out_dir=out_dir)
    finite = [p for p in points if not math.isinf(p["request_rate"])]
    if finite:
        plot_against(finite, "request_rate", "offered requests/s", f"{client.model}: {args.num_prompts} requests "
                     f"per point, seed {args.seed}", out_dir / "sweep.png")
    print(markdown_table(rows))
    if args.search:
        print(f"highest rate with >= {args.goodput_target:.0%} of requests meeting the SLOs: "
              + (f"{best:g} req/s" if best is not None else f"none (even {args.min_rate:g} req/s misses it)"))
    print(f"results: {json_path.parent}")
    return 0


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate
