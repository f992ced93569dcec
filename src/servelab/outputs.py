"""What the engine hands back to users, with vLLM's names. The API server's outputs are deltas (the text, tokens
and logprobs a request gained since its last output, as vLLM's RequestOutputKind.DELTA); add() sums them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # (token_id, logprob) of the most likely tokens at this position, most likely first.
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self) -> "CompletionOutput":
        return CompletionOutput(self.index, self.text, list(self.token_ids), self.cumulative_logprob,
                                list(self.logprobs) if self.logprobs is not None else None, self.finish_reason,
                                self.stop_reason)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None

    def add(self, newer: "RequestOutput") -> None:
        """Append a later delta of the same request (vLLM's RequestOutput.add): each completion's new text,
        token ids and logprobs extend this one's; its finish state and metrics replace this one's."""
        by_index = {c.index: c for c in self.outputs}
        for c in newer.outputs:
            mine = by_index.get(c.index)
            if mine is None:
                self.outputs.append(c.copy())
                continue
            mine.text += c.text
            mine.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + c.logprobs
            mine.cumulative_logprob, mine.finish_reason, mine.stop_reason = (c.cumulative_logprob, c.finish_reason,
                                                                            c.stop_reason)
        self.finished, self.metrics = newer.finished, newer.metrics

    def copy(self) -> "RequestOutput":
        """A copy whose completions and lists are its own (add() on it leaves this one unchanged)."""
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [c.copy() for c in self.outputs],
                             self.finished, self.metrics)
