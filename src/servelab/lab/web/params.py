"""The lab web API's JSON body -> the typed request (lab/api.py) that `servelab lab simulate | advise` builds
from the same flags, so the page runs the command's own code path. Every bad value is a LabInputError naming
the JSON field."""
from __future__ import annotations

import math
from dataclasses import fields as dataclass_fields, replace
from numbers import Real

from servelab.config import SCHEDULE_POLICIES
from servelab.lab.catalog import LOCAL_CPU, gpu_ids, model_ids
from servelab.errors import FieldError
from servelab.lab.catalog.calibration import calibration_names, load_calibration
from servelab.lab.sim.deployment import ROUTERS
from servelab.lab.api import (AdviseRequest, AutoscaleRequest, DeploymentRequest, FrontierRequest, SimulateRequest,
                              TargetsRequest)
from servelab.rate_schedule import parse_rate_schedule
from servelab.lab.web.i18n import Message, error_message
from servelab.workload import DATASETS, WorkloadConfig, generate_workload

# Bounds that keep one simulation to seconds on a shared machine (the CLI has none).
MAX_NUM_PROMPTS = 5000
MAX_NUM_GPUS = 512
MAX_INPUT_LEN = 32768
MAX_OUTPUT_LEN = 8192
MAX_NUM_SEQS = 4096
MAX_PREFIX_LEN = MAX_INPUT_LEN
MAX_NUM_PREFIXES = MAX_NUM_PROMPTS  # more distinct prefixes than requests share nothing more
MAX_ADVISE_GPUS = 64
MAX_REPLICAS = 64
MAX_SCALE_SECONDS = 3600.0
# Prompt + output tokens of the whole workload. Simulation time grows with them, faster for long requests (fewer
# fit in a batch); measured here, 8 M tokens take 1-11 s, and the advisor simulates dozens of shapes. An advisor
# asked to autoscale its shape over a rate schedule gets the room of the page's autoscaling panel at its default
# inputs (a 10-minute ramp of ~2,500 requests, 3.3 M tokens: ~4 s here).
MAX_WORKLOAD_TOKENS = {"simulate": 8_000_000, "advise": 2_000_000, "advise_autoscaled": 4_000_000,
                       "frontier": 400_000}  # the frontier simulates every shape: a short workload
MAX_FRONTIER_GPUS = 16

LIMITS = {"num_prompts": MAX_NUM_PROMPTS, "num_gpus": MAX_NUM_GPUS, "input_len": MAX_INPUT_LEN,
          "output_len": MAX_OUTPUT_LEN, "max_num_seqs": MAX_NUM_SEQS, "max_gpus": MAX_ADVISE_GPUS,
          "prefix_len": MAX_PREFIX_LEN, "num_prefixes": MAX_NUM_PREFIXES,
          "workload_tokens": MAX_WORKLOAD_TOKENS}


class LabInputError(ValueError):
    """A bad request body: a message kind (see messages.py) and the JSON field it is about. str() is English."""

    def __init__(self, message: Message, param: str | None = None) -> None:
        super().__init__(message.render())
        self.message = message
        self.param = param

    def __reduce__(self):  # it travels back from the lab's worker process
        return LabInputError, (self.message, self.param)


def _bad(field: str, kind: str, value, **values) -> LabInputError:
    return LabInputError(Message(kind, {"field": field, "value": repr(value), **values}), field)


def _int(field: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(field, "not_an_integer", value)
    if high is not None and not low <= value <= high:
        raise _bad(field, "not_between", value, low=low, high=high)
    if value < low:
        raise _bad(field, "below", value, low=low)
    return value


def _number(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise _bad(field, "not_finite", value)
    return float(value)


def _positive(field: str, value) -> float:
    number = _number(field, value)
    if number <= 0:
        raise _bad(field, "not_positive", value)
    return number


def _choice(field: str, value, choices) -> str:
    if value not in choices:
        raise _bad(field, "not_a_choice", value, choices=", ".join(choices))
    return value


def _optional(check):
    return lambda field, value: None if value is None else check(field, value)


def _request_rate(field: str, value) -> float:
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0 or not math.isfinite(value):
        raise _bad(field, "bad_rate", value)
    return float(value)


def _range_ratio(field: str, value) -> float:
    ratio = _number(field, value)
    if not 0 <= ratio < 1:
        raise _bad(field, "bad_ratio", value)
    return ratio


def _disaggregate(field: str, value) -> tuple[int, int]:
    parts = value.split(":") if isinstance(value, str) else []
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) >= 1 for part in parts):
        raise _bad(field, "bad_split", value)
    return int(parts[0]), int(parts[1])


def _gpu(field: str, value) -> str:
    _choice(field, value, [*gpu_ids(), LOCAL_CPU])
    if value == LOCAL_CPU:
        from servelab.lab.catalog.cpu_profile import load_cpu_profile
        try:
            load_cpu_profile()
        except ValueError as err:
            raise _bad(field, "needs_profile", value, error=str(err)) from None
    return value


def _gpus(field: str, value) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _bad(field, "not_a_choice", value, choices=", ".join(gpu_ids()))
    return tuple(_choice(field, v, gpu_ids()) for v in value)


def _prices(field: str, value) -> tuple[tuple[str, float], ...]:
    """{"h100": 2.49, ...}: $ per GPU-hour overrides (`--price h100=2.49`)."""
    if not isinstance(value, dict):
        raise LabInputError(Message("not_an_object"), field)
    return tuple((_choice(field, gpu, gpu_ids()), _positive(field, usd)) for gpu, usd in value.items())


def _rate_schedule(field: str, value) -> str:
    # a trace names a file on the server: the command line's, not the web API's
    if not isinstance(value, str) or value.strip().startswith("trace"):
        raise _bad(field, "bad_schedule", value)
    try:
        parse_rate_schedule(value)
    except FieldError:
        raise _bad(field, "bad_schedule", value) from None
    return value


def _seconds(field: str, value) -> float:
    number = _number(field, value)
    if not 0 <= number <= MAX_SCALE_SECONDS:
        raise _bad(field, "not_between", value, low=0, high=int(MAX_SCALE_SECONDS))
    return number


def _flag(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise _bad(field, "not_a_choice", value, choices="true, false")
    return value


def _speculative_config(field: str, value) -> dict:
    """The engine's JSON object; its keys and values are checked where the request is built (a FieldError)."""
    if not isinstance(value, dict):
        raise _bad(field, "not_a_choice", value, choices='{"method": "ngram", "num_speculative_tokens": K}')
    return value


def _fraction(field: str, value) -> float:
    number = _number(field, value)
    if not 0 <= number <= 1:
        raise _bad(field, "not_between", value, low=0, high=1)
    return number


def _engine(field: str, value) -> str:
    return _choice(field, value, sorted({e for name in calibration_names() for e in load_calibration(name).engines()}))


# JSON field -> check. The names are the typed API's fields. Catalog ids only: the web API never opens a path it
# is given.
_DEPLOYMENT = {
    "model": lambda f, v: _choice(f, v, model_ids()),
    "gpu": _gpu,
    "calibration": _optional(lambda f, v: _choice(f, v, calibration_names())),
    "engine": _engine,
    "cuda_graphs": _flag,
    "num_scheduler_steps": lambda f, v: _int(f, v, 1, 64),
    "mixed_batches": _flag,
    "max_num_seqs": _optional(lambda f, v: _int(f, v, 1, MAX_NUM_SEQS)),
    "router": lambda f, v: _choice(f, v, ROUTERS),
    "speculative_config": _optional(_speculative_config),
    "spec_acceptance_rate": _optional(_fraction),
}
_WORKLOAD = {
    "dataset": lambda f, v: _choice(f, v, DATASETS),
    "num_prompts": lambda f, v: _int(f, v, 1, MAX_NUM_PROMPTS),
    "input_len": _optional(lambda f, v: _int(f, v, 1, MAX_INPUT_LEN)),
    "output_len": _optional(lambda f, v: _int(f, v, 1, MAX_OUTPUT_LEN)),
    # the prefix-shared dataset's shape (input_len is then each request's own suffix)
    "prefix_len": _optional(lambda f, v: _int(f, v, 1, MAX_PREFIX_LEN)),
    "num_prefixes": _optional(lambda f, v: _int(f, v, 1, MAX_NUM_PREFIXES)),
    "range_ratio": _range_ratio,
    "request_rate": _request_rate,
    "burstiness": _positive,
    "seed": lambda f, v: _int(f, v, 0),
    "rate_schedule": _optional(_rate_schedule),
}
_TARGETS = {"ttft_target_ms": _optional(_positive), "tpot_target_ms": _optional(_positive)}
_SIMULATE_ONLY = {
    "num_gpus": _optional(lambda f, v: _int(f, v, 1, MAX_NUM_GPUS)),
    "tp": lambda f, v: _int(f, v, 1),
    "schedule": lambda f, v: _choice(f, v, SCHEDULE_POLICIES),
    "disaggregate": _optional(_disaggregate),
}
# The autoscaler's fields are AutoscaleRequest's, `autoscale` its policy (null: a fixed deployment).
_AUTOSCALE = {
    "autoscale": _optional(lambda f, v: _choice(f, v, ["keda", "dynamo"])),
    "min_replicas": lambda f, v: _int(f, v, 1, MAX_REPLICAS),
    "max_replicas": lambda f, v: _int(f, v, 1, MAX_REPLICAS),
    "startup_s": _seconds,
    "cooldown_s": _seconds,
    "interval_s": lambda f, v: _positive(f, _seconds(f, v)),
    "target_waiting": _positive,
    "target_kv_usage": _positive,
}
_FRONTIER = {
    "gpus": _gpus,
    "max_gpus": lambda f, v: _int(f, v, 1, MAX_FRONTIER_GPUS),
    "prices": _prices,
    "latency_metric": lambda f, v: _choice(f, v, ["p99_ttft_ms", "p90_ttft_ms", "median_ttft_ms", "p99_tpot_ms",
                                                  "p90_tpot_ms", "median_tpot_ms"]),
}
FIELDS = {
    "frontier": {**{k: v for k, v in _DEPLOYMENT.items() if k not in ("gpu", "max_num_seqs")}, **_WORKLOAD,
                 **_TARGETS, **_FRONTIER},
    "simulate": {**_DEPLOYMENT, **_SIMULATE_ONLY, **_WORKLOAD, **_TARGETS, **_AUTOSCALE, "slo_attribution": _flag},
    "advise": {**_DEPLOYMENT, **_WORKLOAD, **_TARGETS, **_AUTOSCALE,
               "max_gpus": lambda f, v: _int(f, v, 1, MAX_ADVISE_GPUS)},
}


def _values_for(cls, values: dict) -> dict:
    names = {f.name for f in dataclass_fields(cls)}
    return {k: v for k, v in values.items() if k in names}


def lab_request(command: str, body) -> SimulateRequest | AdviseRequest | FrontierRequest:
    """The typed request of `servelab lab <command> --json` with the body's fields in place of the flags; the
    defaults are the request values' own (the command line's defaults too)."""
    if not isinstance(body, dict):
        raise LabInputError(Message("not_an_object"))
    checks = FIELDS[command]
    unknown = sorted(set(body) - set(checks))
    if unknown:
        raise LabInputError(Message("unknown_field", {"name": repr(unknown[0]), "fields": ", ".join(checks)}),
                            unknown[0])
    values = {field: checks[field](field, value) for field, value in body.items()}
    try:
        deployment = DeploymentRequest(**_values_for(DeploymentRequest, values))
        workload = WorkloadConfig(**_values_for(WorkloadConfig, values))
        targets = TargetsRequest(**_values_for(TargetsRequest, values))
    except FieldError as err:
        raise field_message(err) from None
    _check_size(command, workload, autoscaled=values.get("autoscale") is not None)
    if command == "frontier":
        return replace(FrontierRequest(deployment=deployment, workload=workload, targets=targets),
                       **_values_for(FrontierRequest, values))
    autoscale = None
    if values.get("autoscale") is not None:
        try:
            autoscale = AutoscaleRequest(**{**_values_for(AutoscaleRequest, values), "policy": values["autoscale"]})
            autoscale.build()
        except FieldError as err:
            raise field_message(err) from None
    if command == "simulate":
        return SimulateRequest(deployment, workload, targets, autoscale=autoscale,
                               slo_attribution=values.get("slo_attribution", False))
    return replace(AdviseRequest(deployment, workload, targets), **{**_values_for(AdviseRequest, values),
                                                                    "autoscale": autoscale})


def _check_size(command: str, workload: WorkloadConfig, autoscaled: bool) -> None:
    num_tokens = sum(r.prompt_len + r.output_len for r in generate_workload(workload))  # milliseconds
    limit = MAX_WORKLOAD_TOKENS["advise_autoscaled" if command == "advise" and autoscaled else command]
    if num_tokens > limit:
        raise LabInputError(Message("too_many_tokens", {"num_tokens": f"{num_tokens:,}", "limit": f"{limit:,}",
                                                        "command": command}), "num_prompts")


def field_message(err: ValueError) -> LabInputError:
    """A FieldError names the API's fields, which are the JSON body's: its first field is the error's param."""
    if isinstance(err, LabInputError):
        return err
    return LabInputError(error_message(err), err.field if isinstance(err, FieldError) else None)
