"""Per-request sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

_GREEDY_EPS = 1e-5
# The kinds of grammar a request can constrain its output with (vLLM's structured_outputs fields).
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must match (vLLM's StructuredOutputsParams, one field set): kind is "json" (spec is
    a JSON schema's text), "regex", "choice" (a JSON list of strings) or "grammar" (Lark or GBNF/EBNF text).
    (kind, spec) is the key grammars are compiled and cached by."""
    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_OUTPUT_KINDS}, got {self.kind!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None = up to the model's context length
    logprobs: int | None = None  # number of top logprobs to return besides the chosen token
    skip_special_tokens: bool = True
    # token id -> value added to its logit before sampling (OpenAI's logit_bias, in [-100, 100])
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1 (disable) or >= 1, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()),
             "logit_bias values must be in [-100, 100]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def shapes_logits(self) -> bool:
        """Something besides the model decides which tokens may come next (a grammar or a logit bias)."""
        return self.structured_outputs is not None or bool(self.logit_bias)

    def for_child(self, index: int) -> "SamplingParams":
        """Params of the index-th of n samples: one sequence each, distinct seeds when seeded."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
