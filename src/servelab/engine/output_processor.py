"""Turns engine-core outputs into RequestOutputs: incremental detokenization, stop strings, logprobs,
and merging the n samples of a request. Runs beside the engine core, never on the device, and holds
only values from it: a matched stop string is reported back for the engine to retire the request."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from servelab.core.engine_io import EngineCoreOutput, EngineCoreRequest, EngineCoreTimes
from servelab.core.plan import SampledToken
from servelab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob


@dataclass
class _Sample:
    request: EngineCoreRequest
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    times: EngineCoreTimes
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


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    # engine-core requests whose stop string matched: finished here, still to be retired in the core
    stopped_request_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._sample_of: dict[str, tuple[_ParentState, _Sample]] = {}

    def add_request(self, request: EngineCoreRequest, children: list[EngineCoreRequest]) -> None:
        parent = _ParentState(request.request_id, request.prompt, request.prompt_token_ids)
        for index, child in enumerate(children):
            params = child.sampling_params
            with_logprobs = params.logprobs is not None
            sample = _Sample(
                child,
                CompletionOutput(index, "", [], logprobs=[] if with_logprobs else None,
                                 cumulative_logprob=0.0 if with_logprobs else None),
                IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids, params.skip_special_tokens),
                EngineCoreTimes(child.arrival_time),
            )
            parent.samples.append(sample)
            self._sample_of[child.request_id] = (parent, sample)
        self._parents[request.request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [s.request.request_id for s in parent.samples] if parent else []

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def process(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """A snapshot of every parent request that changed, and the requests a stop string ended."""
        changed: dict[str, _ParentState] = {}
        stopped: list[str] = []
        for out in outputs:
            entry = self._sample_of.get(out.request_id)
            if entry is None:
                continue
            parent, sample = entry
            if sample.completion.finished:
                continue
            sample.times = out.times
            stop = None
            for count, token in enumerate(out.new_tokens, 1):
                # the finish reason belongs to the step's last token
                stop = self._add_token(sample, token, out.finish_reason if count == len(out.new_tokens) else None)
                if stop is not None:
                    break
            if stop is not None:
                # it ended with the token that completed the stop string (the core may have taken more)
                sample.times = replace(out.times, finished=out.times.last_token)
                self._finish(sample, "stop", stop)
                if out.finish_reason is None:
                    stopped.append(out.request_id)
            elif out.finish_reason is not None:
                self._finish(sample, out.finish_reason, self._stop_token_id(sample, out))
            changed[parent.request_id] = parent
        results = [self._snapshot(p) for p in changed.values()]
        for parent in changed.values():
            if parent.finished:
                self._drop(parent)
        return OutputProcessorOutput(results, stopped)

    def _add_token(self, sample: _Sample, token: SampledToken, finish_reason: str | None) -> str | None:
        """Append a token and its text; returns the stop string it completed, if any."""
        completion = sample.completion
        completion.token_ids.append(token.token_id)
        if completion.logprobs is not None and token.logprob is not None:
            completion.logprobs.append(TokenLogprob(token.token_id, token.logprob, token.top_logprobs or []))
            completion.cumulative_logprob += token.logprob
        delta = sample.detokenizer.add(token.token_id)
        if finish_reason == "stop" and _ends_on_stop_token(sample, token.token_id):
            delta = ""  # EOS / a stop token id ends the text without its own text (vLLM's behaviour)
        old_len = len(sample.full_text)
        sample.full_text += delta
        stops = sample.request.sampling_params.stop
        if not stops or finish_reason is not None:
            completion.text = sample.full_text
            return None
        longest = max(len(s) for s in stops)
        window_start = max(0, old_len - longest + 1)
        hits = [(sample.full_text.find(s, window_start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            sample.full_text = sample.full_text[:index]
            return stop
        # Hold back a possible partial stop string until we know it is not one.
        completion.text = sample.full_text[: max(len(completion.text), len(sample.full_text) - longest + 1)]
        return None

    @staticmethod
    def _stop_token_id(sample: _Sample, out: EngineCoreOutput) -> int | None:
        """The stop token id that ended the request; None for EOS, which the core checks first."""
        if out.finish_reason != "stop" or not out.new_tokens:
            return None
        token_id, params = out.new_tokens[-1].token_id, sample.request.sampling_params
        if not params.ignore_eos and token_id in sample.request.eos_token_ids:
            return None
        return token_id if token_id in params.stop_token_ids else None

    @staticmethod
    def _finish(sample: _Sample, finish_reason: str, stop_reason: int | str | None) -> None:
        completion = sample.completion
        completion.text = sample.full_text
        completion.finish_reason = finish_reason
        completion.stop_reason = stop_reason

    def _snapshot(self, parent: _ParentState) -> RequestOutput:
        times = parent.samples[0].times
        metrics = RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished,
                                 sum(s.times.num_preemptions for s in parent.samples))
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


def _ends_on_stop_token(sample: _Sample, token_id: int) -> bool:
    """Whether a request that stopped on token_id stopped because of it (EOS or a stop token id), rather than
    with it (a grammar that token completed keeps its text)."""
    params = sample.request.sampling_params
    return (not params.ignore_eos and token_id in sample.request.eos_token_ids) or token_id in params.stop_token_ids
