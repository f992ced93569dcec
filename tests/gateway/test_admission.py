"""Admission control and API-key checks."""
import asyncio

import pytest

from servelab.gateway.admission import AdmissionControl
from servelab.gateway.auth import ApiKeyAuth
from servelab.gateway.errors import OpenAIError


def status_of(fn) -> int:
    with pytest.raises(OpenAIError) as info:
        fn()
    return info.value.status


def test_request_limit_with_retry_after():
    rejected = []
    admission = AdmissionControl(max_num_queued_requests=2, max_queued_tokens=1000, on_reject=rejected.append)
    a, b = admission.admit([10]), admission.admit([10])
    with pytest.raises(OpenAIError) as info:
        admission.admit([10])
    assert info.value.status == 429 and int(info.value.headers["Retry-After"]) >= 1
    assert rejected == ["queue_full"]
    a.started(0)  # first token out: no longer queued, still in flight
    c = admission.admit([10])
    assert (admission.num_queued, admission.num_in_flight) == (2, 3)
    for ticket in (a, b, c):
        ticket.release()
        ticket.release()  # idempotent
    assert (admission.num_queued, admission.num_queued_tokens, admission.num_in_flight) == (0, 0, 0)


def test_token_limit_and_oversized_request_into_empty_queue():
    admission = AdmissionControl(max_num_queued_requests=100, max_queued_tokens=100)
    big = admission.admit([500])  # alone over the limit: admitted only because nothing else waits
    assert status_of(lambda: admission.admit([1])) == 429
    big.release()
    small = admission.admit([60, 30])  # several engine requests of one call, all or none
    assert status_of(lambda: admission.admit([20])) == 429
    small.started(0)
    admission.admit([20])
    assert admission.num_queued_tokens == 50


def test_draining_refuses_with_503():
    rejected = []
    admission = AdmissionControl(10, 10, on_reject=rejected.append)
    admission.draining = True
    assert status_of(lambda: admission.admit([1])) == 503
    assert rejected == ["draining"]


def test_wait_idle_is_bounded():
    admission = AdmissionControl(10, 100)
    ticket = admission.admit([1])

    async def main():
        assert not await admission.wait_idle(0.05)
        asyncio.get_running_loop().call_later(0.05, ticket.release)
        assert await admission.wait_idle(5)

    asyncio.run(main())


def test_api_keys():
    auth = ApiKeyAuth(("k1", "k2"))
    assert auth.check("Bearer k1") and auth.check("bearer k2") and auth.check("Bearer  k1 ")
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1", "Bearer k1x"):
        assert not auth.check(header), header
    assert ApiKeyAuth(()).check(None)
