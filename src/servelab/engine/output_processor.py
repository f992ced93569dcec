"""Turns engine-core token updates into RequestOutputs: incremental detokenization, stop strings,
logprobs, and merging the n samples of a request. Runs beside the engine core, never on the device."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from servelab.core.engine import EngineCoreOutput
from servelab.core.request import Request, RequestStatus
from servelab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob


@dataclass
class _Sample:
    request: Request
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    full_text: str = ""


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, on_stop: Callable[[Request], None]) -> None:
        """on_stop retires a request in the engine core when one of its stop strings matched."""
        self.tokenizer = tokenizer
        self.on_stop = on_stop
        self._parents: dict[str, _ParentState] = {}
        self._sample_of: dict[str, tuple[_ParentState, _Sample]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        parent = _ParentState(request_id, prompt, children[0].prompt_token_ids)
        for index, child in enumerate(children):
            params = child.sampling_params
            sample = _Sample(
                child,
                CompletionOutput(index, "", child.output_token_ids, logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None),
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params.skip_special_tokens),
            )
            parent.samples.append(sample)
            self._sample_of[child.request_id] = (parent, sample)
        self._parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [s.request.request_id for s in parent.samples] if parent else []

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Returns a snapshot of every parent request that changed."""
        changed: dict[str, _ParentState] = {}
        for out in outputs:
            entry = self._sample_of.get(out.request.request_id)
            if entry is None:
                continue
            parent, sample = entry
            if out.new_token is not None and self._add_token(sample, out):
                self.on_stop(sample.request)
            if sample.request.finished and not sample.completion.finished:
                self._finish(sample)
            changed[parent.request_id] = parent
        results = [self._snapshot(p) for p in changed.values()]
        for parent in changed.values():
            if parent.finished:
                self._drop(parent)
        return results

    def _add_token(self, sample: _Sample, out: EngineCoreOutput) -> bool:
        request, token = sample.request, out.new_token
        params = request.sampling_params
        if sample.completion.logprobs is not None and token.logprob is not None:
            sample.completion.logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs or []))
            sample.completion.cumulative_logprob += token.logprob
        delta = sample.detokenizer.add(token.token_id)
        # EOS / stop token ids end the text without their own text (vLLM's behaviour).
        ended_by_token = request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason is None
        if ended_by_token or (request.stop_reason is not None and request.stop_reason == token.token_id):
            delta = ""
        old_len = len(sample.full_text)
        sample.full_text += delta
        if params.stop and not request.finished:
            longest = max(len(s) for s in params.stop)
            window_start = max(0, old_len - longest + 1)
            hits = [(sample.full_text.find(s, window_start), s) for s in params.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                sample.full_text = sample.full_text[:index]
                sample.completion.text = sample.full_text
                request.stop_reason = stop
                return True
            # Hold back a possible partial stop string until we know it is not one.
            sample.completion.text = sample.full_text[: max(len(sample.completion.text),
                                                           len(sample.full_text) - longest + 1)]
        else:
            sample.completion.text = sample.full_text
        return False

    def _finish(self, sample: _Sample) -> None:
        request = sample.request
        sample.completion.text = sample.full_text
        sample.completion.finish_reason = request.status.value
        sample.completion.stop_reason = request.stop_reason

    def _snapshot(self, parent: _ParentState) -> RequestOutput:
        first = parent.samples[0].request
        times = first.times
        metrics = RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished,
                                 sum(s.request.num_preemptions for s in parent.samples))
        completions = [
            CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                             list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)
            for c in (s.completion for s in parent.samples)
        ]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, metrics)

    def _drop(self, parent: _ParentState) -> None:
        self._parents.pop(parent.request_id, None)
        for s in parent.samples:
            self._sample_of.pop(s.request.request_id, None)
