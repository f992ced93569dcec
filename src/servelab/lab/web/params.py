"""The lab API's JSON body -> the argparse Namespace `servelab lab simulate | advise` would build from the
same flags, so the page runs the command's own code path. Every bad value is a LabInputError naming the
JSON field."""
from __future__ import annotations

import argparse
import math
import re
from numbers import Real

from servelab.config import SCHEDULE_POLICIES
from servelab.lab.catalog import LOCAL_CPU, gpu_ids, model_ids
from servelab.lab.cli import build_lab_parser, split_ratio, workload_from_args
from servelab.workload import DATASETS, generate_workload

# Bounds that keep one simulation to seconds on a shared machine (the CLI has none).
MAX_NUM_PROMPTS = 5000
MAX_NUM_GPUS = 512
MAX_INPUT_LEN = 32768
MAX_OUTPUT_LEN = 8192
MAX_NUM_SEQS = 4096
MAX_ADVISE_GPUS = 64
# Prompt + output tokens of the whole workload. Simulation time grows with them, faster for long requests (fewer
# fit in a batch); measured here, 8 M tokens take 1-11 s, and the advisor simulates dozens of shapes.
MAX_WORKLOAD_TOKENS = {"simulate": 8_000_000, "advise": 2_000_000}

LIMITS = {"num_prompts": MAX_NUM_PROMPTS, "num_gpus": MAX_NUM_GPUS, "input_len": MAX_INPUT_LEN,
          "output_len": MAX_OUTPUT_LEN, "max_num_seqs": MAX_NUM_SEQS, "max_gpus": MAX_ADVISE_GPUS,
          "workload_tokens": MAX_WORKLOAD_TOKENS}


class LabInputError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise LabInputError(message)


def _int(field: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LabInputError(f"{field} must be an integer, got {value!r}", field)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise LabInputError(f"{field} must be {bound}, got {value}", field)
    return value


def _number(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise LabInputError(f"{field} must be a finite number, got {value!r}", field)
    return float(value)


def _positive(field: str, value) -> float:
    number = _number(field, value)
    if number <= 0:
        raise LabInputError(f"{field} must be > 0, got {value!r}", field)
    return number


def _choice(field: str, value, choices) -> str:
    if value not in choices:
        raise LabInputError(f"{field} must be one of {', '.join(choices)}, got {value!r}", field)
    return value


def _optional(check):
    return lambda field, value: None if value is None else check(field, value)


def _request_rate(field: str, value) -> float:
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0 or not math.isfinite(value):
        raise LabInputError(f'{field} must be a number > 0 (requests/s) or "inf", got {value!r}', field)
    return float(value)


def _range_ratio(field: str, value) -> float:
    ratio = _number(field, value)
    if not 0 <= ratio < 1:
        raise LabInputError(f"{field} must be in [0, 1), got {value!r}", field)
    return ratio


def _disaggregate(field: str, value) -> tuple[int, int]:
    if not isinstance(value, str):
        raise LabInputError(f"{field} must be a string like \"1:3\" or null, got {value!r}", field)
    try:
        return split_ratio(value)
    except argparse.ArgumentTypeError as err:
        raise LabInputError(f"{field}: {err}", field) from None


def _gpu(field: str, value) -> str:
    _choice(field, value, [*gpu_ids(), LOCAL_CPU])
    if value == LOCAL_CPU:
        from servelab.lab.catalog.cpu_profile import load_cpu_profile
        try:
            load_cpu_profile()
        except ValueError as err:
            raise LabInputError(f"{field} {LOCAL_CPU!r} needs this machine's profile: {err}", field) from None
    return value


# JSON field -> (Namespace attribute, check). Catalog ids only: the web API never opens a path it is given.
_COMMON = {
    "model": ("model", lambda f, v: _choice(f, v, model_ids())),
    "gpu": ("gpu", _gpu),
    "max_num_seqs": ("max_num_seqs", _optional(lambda f, v: _int(f, v, 1, MAX_NUM_SEQS))),
    "dataset": ("dataset", lambda f, v: _choice(f, v, DATASETS)),
    "num_prompts": ("num_prompts", lambda f, v: _int(f, v, 1, MAX_NUM_PROMPTS)),
    "input_len": ("input_len", _optional(lambda f, v: _int(f, v, 1, MAX_INPUT_LEN))),
    "output_len": ("output_len", _optional(lambda f, v: _int(f, v, 1, MAX_OUTPUT_LEN))),
    "range_ratio": ("range_ratio", _range_ratio),
    "request_rate": ("request_rate", _request_rate),
    "burstiness": ("burstiness", _positive),
    "seed": ("seed", lambda f, v: _int(f, v, 0)),
    "ttft_target_ms": ("ttft_target", _optional(_positive)),
    "tpot_target_ms": ("tpot_target", _optional(_positive)),
}
FIELDS = {
    "simulate": {
        **_COMMON,
        "num_gpus": ("num_gpus", _optional(lambda f, v: _int(f, v, 1, MAX_NUM_GPUS))),
        "tp": ("tp", lambda f, v: _int(f, v, 1)),
        "schedule": ("schedule", lambda f, v: _choice(f, v, SCHEDULE_POLICIES)),
        "disaggregate": ("disaggregate", _optional(_disaggregate)),
    },
    "advise": {**_COMMON, "max_gpus": ("max_gpus", lambda f, v: _int(f, v, 1, MAX_ADVISE_GPUS))},
}
_FLAG_FIELDS = {"ttft-target": "ttft_target_ms", "tpot-target": "tpot_target_ms"}


def lab_args(command: str, body) -> argparse.Namespace:
    """The Namespace of `servelab lab <command> --json` with the body's fields in place of the flags; the
    defaults come from the command's own parser."""
    if not isinstance(body, dict):
        raise LabInputError("the request body must be a JSON object")
    fields = FIELDS[command]
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise LabInputError(f"unknown field {unknown[0]!r}; the fields are {', '.join(fields)}", unknown[0])
    args = build_lab_parser(_RaisingParser).parse_args([command, "--json"])
    for field, value in body.items():
        attribute, check = fields[field]
        setattr(args, attribute, check(field, value))
    _check_size(command, args)
    return args


def _check_size(command: str, args: argparse.Namespace) -> None:
    workload = generate_workload(workload_from_args(args))  # milliseconds; the run itself regenerates it
    num_tokens = sum(r.prompt_len + r.output_len for r in workload)
    limit = MAX_WORKLOAD_TOKENS[command]
    if num_tokens > limit:
        raise LabInputError(f"the workload has {num_tokens:,} prompt + output tokens, over the lab's {limit:,} per "
                            f"{command}; send fewer (num_prompts) or shorter requests", "num_prompts")


def field_message(err: ValueError) -> LabInputError:
    """A simulator error names command-line flags (`--num-gpus 4 is not a multiple of --tp 3`); the web API
    names the JSON fields instead, and reports the first one as the error's param."""
    if isinstance(err, LabInputError):
        return err
    names: list[str] = []

    def to_field(match: re.Match) -> str:
        name = _FLAG_FIELDS.get(match[1], match[1].replace("-", "_"))
        names.append(name)
        return name

    message = re.sub(r"--([a-z][a-z-]*)", to_field, str(err))
    return LabInputError(message, names[0] if names else None)
