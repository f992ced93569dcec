"""Schemathesis against a running gateway: every /v1 operation of the schema the server publishes, with
bodies that fit the schema (positive) and bodies that do not (negative), a fifth of them without the API key,
plus the methods the schema does not list. Each response is validated with schemathesis's checks (documented
status, content type, body against the schema, invalid data refused) and `openai_error_body`. Left out:
schemathesis's positive_data_acceptance (a schema-valid body must get 2xx), because the schema gives types,
not the server's value rules (n >= 1, a non-empty prompt, prompt + max_tokens within the context), which
answer 400 with the field named. Shared by the bounded test
(tests/gateway/test_fuzz_schema.py) and the longer benchmark (benchmarks/fuzz/run.py)."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import httpx
import schemathesis
import hypothesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi import checks as openapi_checks

FUZZED_PATHS = r"^/v1/(completions|chat/completions|models)$"  # /v1/metrics/stream never ends: not fuzzed
# The schema's integers are unbounded, but generated ones rarely leave 64 bits: every third body has its
# integers swapped for these edges (a seed past 64 bits was a 500 that went unnoticed).
EDGE_INTEGERS = (2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, -1, 0)


def widen_integers(value, pick: int):
    """value with each integer (not bool) replaced by an edge integer chosen from pick and its place."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return EDGE_INTEGERS[pick % len(EDGE_INTEGERS)]
    if isinstance(value, list):
        return [widen_integers(v, pick + i) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: widen_integers(v, pick + i) for i, (k, v) in enumerate(value.items())}
    return value
OTHER_METHODS = ("GET", "PUT", "PATCH", "DELETE", "POST")


@dataclass
class FuzzReport:
    num_cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def openai_error_body(secret: str):
    @schemathesis.check
    def openai_error_body(ctx, response, case) -> None:
        """Every error is OpenAI's {"error": {message, type, param, code}}; no 5xx for any input; the key is
        never echoed."""
        assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
        assert secret not in response.text
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text[:300]

    return openai_error_body


def run_fuzz(url: str, api_key: str, examples_per_mode: int, seed: int = 0) -> FuzzReport:
    report = FuzzReport()
    check = openai_error_body(api_key)
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json").include(path_regex=FUZZED_PATHS)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} == {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @hypothesis.seed(seed)  # reproducible: one seed per run
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples_per_mode, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            def one(case) -> None:
                report.num_cases += 1
                with_key = report.num_cases % 5 != 0
                if report.num_cases % 3 == 0 and isinstance(case.body, dict):
                    case.body = widen_integers(case.body, report.num_cases)
                headers = {"Authorization": f"Bearer {api_key}"} if with_key else {}
                try:
                    response = case.call(base_url=url, headers=headers, timeout=60)
                except Exception as exc:  # the server hung up or did not answer: a failure, not a crash here
                    report.failures.append(f"{operation.label} [{mode}]: no answer: {exc!r}")
                    return
                report.statuses[response.status_code] += 1
                try:
                    case.validate_response(response, additional_checks=[check],
                                           excluded_checks=[openapi_checks.positive_data_acceptance])
                except BaseException as exc:  # schemathesis raises a FailureGroup (a BaseExceptionGroup)
                    if not isinstance(exc, (Exception, BaseExceptionGroup)):
                        raise
                    report.failures.append(f"{operation.label} [{mode}] {case.body!r:.300}: {exc}")

            one()
    with httpx.Client(timeout=30) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
            for method in OTHER_METHODS:
                if (method == "POST") == (path != "/v1/models"):
                    continue  # the documented method
                response = http.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {api_key}"})
                report.num_cases += 1
                report.statuses[response.status_code] += 1
                if response.status_code != 405 or set(response.json()["error"]) != {"message", "type", "param",
                                                                                        "code"}:
                    report.failures.append(f"{method} {path}: {response.status_code} {response.text[:200]}")
    return report
