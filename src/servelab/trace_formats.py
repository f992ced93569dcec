"""Readers for the public LLM serving traces, each row made a TraceRecord (arrival, prompt and output lengths,
and where the trace says so, which prompt blocks it shares with other requests).

- azure: Azure LLM inference traces (AzurePublicDataset, AzureLLMInferenceTrace_{code,conv}.csv):
  CSV with TIMESTAMP (a date and time), ContextTokens, GeneratedTokens.
- burstgpt: BurstGPT (HPMLL/BurstGPT, BurstGPT_*.csv): CSV with Timestamp (seconds from the trace's start),
  Model, Request tokens, Response tokens, Total tokens, Log Type. Rows with no response (failures) are skipped.
- mooncake: Mooncake / Kimi traces (kvcache-ai/Mooncake, mooncake_trace.jsonl): JSON lines with timestamp (ms),
  input_length, output_length and hash_ids, one id per 512-token block of the prompt; equal ids are equal
  blocks (with equal prefixes), so prefix reuse is known.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE_FORMATS = ("azure", "burstgpt", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRecord:
    arrival_time: float  # seconds after the trace's first request
    prompt_len: int
    output_len: int
    block_hash_ids: tuple[int, ...] = ()  # mooncake: one id per MOONCAKE_BLOCK_TOKENS prompt tokens


class TraceError(ValueError):
    pass


def _number(value: str | int | float | None, where: str, name: str) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} is not a number: {value!r}") from None


def _int(value: str | int | float | None, where: str, name: str) -> int:
    return int(_number(value, where, name))


def _azure_time(text: str, where: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, which datetime does not parse
    head, _, frac = text.strip().partition(".")
    try:
        t = datetime.fromisoformat(head).timestamp()
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP is not a date and time: {text!r}") from None
    return t + (float("0." + frac) if frac.isdigit() else 0.0)


def _read_csv(path: Path, columns: tuple[str, ...]) -> list[tuple[str, dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                             f"(has {', '.join(reader.fieldnames or []) or 'none'})")
        return [(f"{path}:{number}", row) for number, row in enumerate(reader, start=2)]


def read_azure(path: Path) -> list[TraceRecord]:
    rows = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    raw = [(_azure_time(r["TIMESTAMP"], w), _int(r["ContextTokens"], w, "ContextTokens"),
            _int(r["GeneratedTokens"], w, "GeneratedTokens")) for w, r in rows]
    return _records(raw)


def read_burstgpt(path: Path) -> list[TraceRecord]:
    rows = _read_csv(path, ("Timestamp", "Request tokens", "Response tokens"))
    raw = [(_number(r["Timestamp"], w, "Timestamp"), _int(r["Request tokens"], w, "Request tokens"), _int(r["Response tokens"], w, "Response tokens"))
           for w, r in rows]
    return _records([r for r in raw if r[2] > 0])


def read_mooncake(path: Path) -> list[TraceRecord]:
    raw = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise TraceError(f"{where}: not JSON ({err.msg})") from None
            if not isinstance(item, dict):
                raise TraceError(f"{where}: expected an object with timestamp, input_length, output_length")
            prompt_len = _int(item.get("input_length"), where, "input_length")
            ids = item.get("hash_ids", [])
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            if ids and len(ids) != -(-prompt_len // MOONCAKE_BLOCK_TOKENS):
                raise TraceError(f"{where}: {len(ids)} hash_ids for {prompt_len} tokens; expected one per "
                                 f"{MOONCAKE_BLOCK_TOKENS}-token block")
            raw.append((_number(item.get("timestamp"), where, "timestamp") / 1000.0, prompt_len,
                        _int(item.get("output_length"), where, "output_length"), tuple(ids)))
    return _records(raw)


def _records(raw: list[tuple]) -> list[TraceRecord]:
    rows = [r for r in raw if r[1] >= 1 and r[2] >= 1]
    if not rows:
        raise TraceError("the trace has no requests with a prompt and an output")
    rows.sort(key=lambda r: r[0])
    start = rows[0][0]
    return [TraceRecord(r[0] - start, *r[1:]) for r in rows]


READERS = {"azure": read_azure, "burstgpt": read_burstgpt, "mooncake": read_mooncake}


def read_trace(path: str | Path, trace_format: str) -> list[TraceRecord]:
    if trace_format not in READERS:
        raise TraceError(f"trace format must be one of {', '.join(TRACE_FORMATS)}, got {trace_format!r}")
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    return READERS[trace_format](path)


def add_trace_args(p) -> None:
    """The replay flags of `lab simulate` and `bench serve` (argparse)."""
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a public trace's arrivals and lengths instead of the dataset (see --trace-format)")
    p.add_argument("--trace-format", choices=TRACE_FORMATS, default=None,
                   help="azure: Azure LLM inference CSV; burstgpt: BurstGPT CSV; mooncake: Mooncake/Kimi JSONL "
                        "with hash_ids (shared prompt blocks)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time by this (0.5 replays twice as fast)")
    p.add_argument("--max-requests", type=int, default=None, help="replay the trace's first N requests")
    p.add_argument("--sample", type=int, default=None, help="replay N of the trace's requests drawn with --seed")


def trace_fields(args) -> dict:
    """WorkloadConfig's trace fields from the flags add_trace_args added."""
    return {"trace": args.trace, "trace_format": args.trace_format, "time_scale": args.time_scale,
            "max_requests": args.max_requests, "sample": args.sample}
