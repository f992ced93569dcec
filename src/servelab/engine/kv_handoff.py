"""Disaggregated prefill/decode, the API server's values: the request a prefill core runs (its first token
only, its KV held afterwards) and the request a decode core gets once that token is out (the token, the times
it was scheduled and sampled, and which core sends the KV under which tag)."""
from __future__ import annotations

from dataclasses import replace

from servelab.core.engine_io import EngineCoreRequest, KVTransferParams
from servelab.core.plan import SampledToken
from servelab.engine.core_protocol import RequestDelta


def prefill_request(request: EngineCoreRequest) -> tuple[EngineCoreRequest, EngineCoreRequest | None]:
    """(what the prefill core runs, what a decode core will get; None when the first token is all of it)."""
    if request.max_tokens <= 1:
        return request, None
    return replace(request, max_tokens=1, kv_transfer=KVTransferParams(do_remote_decode=True)), request


def decode_request(request: EngineCoreRequest, prefilled: RequestDelta, prefill_index: int,
                   tag: int) -> EngineCoreRequest:
    """The decode core's request once the prefill core's request ended with its first token (`prefilled`, the
    prefill's deltas): that token, the times it was scheduled and sampled, and which core sends the KV under
    which tag."""
    logprob = prefilled.new_logprobs[0] if prefilled.new_logprobs else None
    first = SampledToken(prefilled.new_token_ids[0], logprob.logprob if logprob else None,
                         logprob.top_logprobs if logprob else None)
    times = prefilled.times
    params = KVTransferParams(do_remote_prefill=True, remote_engine=prefill_index, tag=tag, first_token=first,
                              first_scheduled_time=times.first_scheduled, first_token_time=times.first_token)
    return replace(request, kv_transfer=params)
