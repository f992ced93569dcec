"""Disaggregated prefill/decode, the API server's values: the request a prefill core runs (its first token
only, its KV held afterwards), the request a decode core gets once that token is out (the token, the times
it was scheduled and sampled, and which core sends the KV under which tag), and the snapshot the client
sees meanwhile (the first token, not finished)."""
from __future__ import annotations

from dataclasses import replace

from servelab.core.engine_io import EngineCoreRequest, KVTransferParams
from servelab.core.plan import SampledToken
from servelab.outputs import RequestOutput


def prefill_request(request: EngineCoreRequest) -> tuple[EngineCoreRequest, EngineCoreRequest | None]:
    """(what the prefill core runs, what a decode core will get; None when the first token is all of it)."""
    if request.max_tokens <= 1:
        return request, None
    return replace(request, max_tokens=1, kv_transfer=KVTransferParams(do_remote_decode=True)), request


def decode_request(request: EngineCoreRequest, prefilled: RequestOutput, prefill_index: int,
                   tag: int) -> EngineCoreRequest | None:
    """The decode core's request once the prefill core finished `prefilled`; None when it ended there
    (its first token was a stop: the prefill core freed the blocks)."""
    completion = prefilled.outputs[0]
    if completion.finish_reason != "length":
        return None
    logprob = completion.logprobs[0] if completion.logprobs else None
    first = SampledToken(completion.token_ids[0], logprob.logprob if logprob else None,
                         logprob.top_logprobs if logprob else None)
    metrics = prefilled.metrics
    params = KVTransferParams(do_remote_prefill=True, remote_engine=prefill_index, tag=tag, first_token=first,
                              first_scheduled_time=metrics.first_scheduled_time if metrics else None,
                              first_token_time=metrics.first_token_time if metrics else None)
    return replace(request, kv_transfer=params)


def first_token_output(prefilled: RequestOutput) -> RequestOutput:
    """The prefill core's final snapshot as the client sees it: one token, still running."""
    running = replace(prefilled.outputs[0], finish_reason=None, stop_reason=None)
    return replace(prefilled, outputs=[running], finished=False)
