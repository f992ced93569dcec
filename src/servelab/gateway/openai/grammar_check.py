"""A request's grammars checked before it is admitted, so a bad schema is a 400 naming the problem rather than
a request the engine fails later. Checking compiles the grammar against the model's tokenizer and computes
its first mask, in a thread with a deadline (llguidance's own limits bound the work; the deadline is the last
word); results are cached by grammar."""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Callable

import llguidance

from servelab.gateway.errors import bad_request
from servelab.sampling_params import StructuredOutputsParams
from servelab.structured_output import GrammarError, compile_matcher, grammar_text

CHECK_TIMEOUT_S = 10.0
MAX_CACHED = 1024


class GrammarChecker:
    def __init__(self, tokenizer_factory: Callable[[], llguidance.LLTokenizer]) -> None:
        """tokenizer_factory builds llguidance's tokenizer on the first check (~0.4 s for 49k tokens)."""
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._problems: OrderedDict[StructuredOutputsParams, str | None] = OrderedDict()

    def _problem(self, params: StructuredOutputsParams) -> str | None:
        try:
            grammar_text(params)  # the shape limits first, before any tokenizer is built
        except GrammarError as exc:
            return str(exc)
        with self._lock:
            if params in self._problems:
                return self._problems[params]
            if self._tokenizer is None:
                try:
                    self._tokenizer = self._tokenizer_factory()
                except ValueError as exc:  # llguidance cannot read this tokenizer
                    return f"structured output is not available for this model's tokenizer: {exc}"
            tokenizer = self._tokenizer
        try:
            compile_matcher(params, tokenizer)
            problem = None
        except GrammarError as exc:
            problem = str(exc)
        with self._lock:
            self._problems[params] = problem
            if len(self._problems) > MAX_CACHED:
                self._problems.popitem(last=False)
        return problem

    async def check(self, grammars: list[tuple[str, StructuredOutputsParams]]) -> None:
        """A 400 naming the field of the first grammar that is malformed, over a limit or too slow to check."""
        for param, params in grammars:
            try:
                problem = await asyncio.wait_for(asyncio.to_thread(self._problem, params), CHECK_TIMEOUT_S)
            except asyncio.TimeoutError as exc:
                raise bad_request(f"{param}: the grammar took over {CHECK_TIMEOUT_S:g} s to check; simplify it",
                                  param=param) from exc
            if problem is not None:
                raise bad_request(f"{param}: {problem}", param=param)
