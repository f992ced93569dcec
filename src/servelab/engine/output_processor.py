"""Turns the engine core's RequestDeltas into RequestOutputs: incremental detokenization, stop strings,
logprobs, and merging the n samples of a request. Runs in the API server's process (AsyncLLM) or beside an
in-process engine (the offline LLM), never in the engine core's loop, and holds only values from it: a
matched stop string is reported back for the core to retire the request.

Outputs are deltas (the text, token ids and logprobs each sample gained; vLLM's RequestOutputKind.DELTA),
so a step costs what it added, not what the request holds; with cumulative=True (the offline LLMEngine) each
output is instead the whole request so far."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from servelab.core.engine_io import EngineCoreRequest, EngineCoreTimes
from servelab.engine.core_proc.core_protocol import RequestDelta
from servelab.model.tokenizer import IncrementalDetokenizer, Tokenizer
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class _Sample:
    request: EngineCoreRequest
    completion: CompletionOutput  # the sample so far
    detokenizer: IncrementalDetokenizer
    times: EngineCoreTimes
    full_text: str = ""  # completion.text plus what is held back as a possible stop string
    # how much of completion has gone out in deltas
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    sent_finish: bool = False


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
    # for each of those, the output tokens it kept (up to the one that completed the stop string)
    stopped_num_tokens: list[int] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, cumulative: bool = False) -> None:
        self.tokenizer = tokenizer
        self.cumulative = cumulative
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

    def forget(self, request_id: str) -> None:
        parent = self._parents.get(request_id)
        if parent is not None:
            self._drop(parent)

    def process(self, deltas: list[RequestDelta]) -> OutputProcessorOutput:
        """An output for every parent request that changed, and the requests a stop string ended."""
        changed: dict[str, _ParentState] = {}
        result = OutputProcessorOutput([], [])
        for delta in deltas:
            entry = self._sample_of.get(delta.request_id)
            if entry is None:
                continue
            parent, sample = entry
            if sample.completion.finished:
                continue
            sample.times = delta.times
            stop = self._add_tokens(sample, delta)
            if stop is not None:
                # it ended with the token that completed the stop string; what the core sampled after is dropped
                sample.times = replace(delta.times, finished=delta.times.last_token)
                self._finish(sample, "stop", stop)
                result.stopped_request_ids.append(delta.request_id)
                result.stopped_num_tokens.append(len(sample.completion.token_ids))
            elif delta.finish_reason is not None:
                self._finish(sample, delta.finish_reason, self._stop_token_id(sample, delta))
            changed[parent.request_id] = parent
        make = self._snapshot if self.cumulative else self._delta
        result.request_outputs = [make(p) for p in changed.values()]
        for parent in changed.values():
            if parent.finished:
                self._drop(parent)
        return result

    def _add_tokens(self, sample: _Sample, delta: RequestDelta) -> str | None:
        """Append the delta's tokens and their text; returns the stop string one of them completed, if any."""
        completion = sample.completion
        last = len(delta.new_token_ids) - 1
        for i, token_id in enumerate(delta.new_token_ids):
            completion.token_ids.append(token_id)
            if completion.logprobs is not None and delta.new_logprobs is not None and i < len(delta.new_logprobs):
                entry = delta.new_logprobs[i]
                completion.logprobs.append(entry)
                completion.cumulative_logprob += entry.logprob
            finish_reason = delta.finish_reason if i == last else None
            text = sample.detokenizer.add(token_id)
            if finish_reason == "stop" and _ends_on_stop_token(sample, token_id):
                text = ""  # EOS / a stop token id ends the text without its own text (vLLM's behaviour)
            stop = self._add_text(sample, text, finish_reason)
            if stop is not None:
                return stop
        return None

    @staticmethod
    def _add_text(sample: _Sample, text: str, finish_reason: str | None) -> str | None:
        completion = sample.completion
        old_len = len(sample.full_text)
        sample.full_text += text
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
    def _stop_token_id(sample: _Sample, delta: RequestDelta) -> int | None:
        """The stop token id that ended the request; None for EOS, which the core checks first."""
        if delta.finish_reason != "stop" or not delta.new_token_ids:
            return None
        token_id, params = delta.new_token_ids[-1], sample.request.sampling_params
        if not params.ignore_eos and token_id in sample.request.eos_token_ids:
            return None
        return token_id if token_id in params.stop_token_ids else None

    @staticmethod
    def _finish(sample: _Sample, finish_reason: str, stop_reason: int | str | None) -> None:
        completion = sample.completion
        completion.text = sample.full_text
        completion.finish_reason = finish_reason
        completion.stop_reason = stop_reason

    @staticmethod
    def _metrics(parent: _ParentState) -> RequestMetrics:
        times = parent.samples[0].times
        return RequestMetrics(times.arrival, times.first_scheduled, times.first_token, times.finished,
                              sum(s.times.num_preemptions for s in parent.samples))

    def _snapshot(self, parent: _ParentState) -> RequestOutput:
        completions = [s.completion.copy() for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, self._metrics(parent))

    def _delta(self, parent: _ParentState) -> RequestOutput:
        completions = []
        for s in parent.samples:
            c = s.completion
            num_tokens, num_chars = len(c.token_ids), len(c.text)
            if num_tokens == s.num_sent_tokens and num_chars == s.num_sent_chars and c.finished == s.sent_finish:
                continue
            logprobs = None if c.logprobs is None else c.logprobs[s.num_sent_tokens:]
            completions.append(CompletionOutput(c.index, c.text[s.num_sent_chars:], c.token_ids[s.num_sent_tokens:],
                                                c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason))
            s.num_sent_tokens, s.num_sent_chars, s.sent_finish = num_tokens, num_chars, c.finished
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, self._metrics(parent))

    def _drop(self, parent: _ParentState) -> None:
        self._parents.pop(parent.request_id, None)
        for s in parent.samples:
            self._sample_of.pop(s.request.request_id, None)


def _ends_on_stop_token(sample: _Sample, token_id: int) -> bool:
    """Whether a request that stopped on token_id stopped because of it (EOS or a stop token id), rather than
    with it (a grammar that token completed keeps its text)."""
    params = sample.request.sampling_params
    return (not params.ignore_eos and token_id in sample.request.eos_token_ids) or token_id in params.stop_token_ids
