"""The structured-output side of an engine core: compiles grammars off the engine thread, keeps one matcher
per constrained request, fills the step's token bitmask and advances the matchers with the sampled tokens.

Grammars compile in a small thread pool (llguidance drops the GIL while it builds), cached by
(kind, spec): a request's matcher is a copy of its grammar's compiled template, so a schema a thousand
requests share is compiled once. EngineCore keeps a request out of the scheduler until its grammar is
ready, so a slow compile never holds up the batch."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from servelab.core.plan import StepPlan, StepResult
from servelab.core.request import Request
from servelab.sampling_params import StructuredOutputsParams
from servelab.structured_output.grammar import GrammarError, compile_matcher

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512


def ll_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a `tokenizers` tokenizer, over the model's vocabulary (its logits' width, which may
    exceed the tokenizer's). Takes ~0.4 s for a 49k vocabulary: build it once."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


@dataclass
class _RequestGrammar:
    request: Request
    template: Future  # Future[llguidance.LLMatcher]: the compiled grammar, shared
    matcher: llguidance.LLMatcher | None = None
    error: str | None = None


class StructuredOutputManager:
    def __init__(self, tokenizer_factory: Callable[[], llguidance.LLTokenizer], vocab_size: int,
                 num_compile_threads: int = 2) -> None:
        """tokenizer_factory builds the llguidance tokenizer, on first use and in the compile pool."""
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_compile_threads, thread_name_prefix="grammar-compile")
        self._templates: OrderedDict[StructuredOutputsParams, Future] = OrderedDict()
        self._grammars: dict[str, _RequestGrammar] = {}
        self._mask_executor: llguidance.LLExecutor | None = None
        # fills each step's bitmask while the forward pass runs (llguidance drops the GIL)
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    # ---- requests
    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        assert params is not None
        self._grammars[request.request_id] = _RequestGrammar(request, self._template(params))

    def is_ready(self, request_id: str) -> bool:
        """Whether the request's grammar is compiled (or failed: see error)."""
        grammar = self._grammars.get(request_id)
        return grammar is None or grammar.template.done()

    def error(self, request_id: str) -> str | None:
        """Why the request's grammar could not be used, once it is ready; None when it can."""
        grammar = self._grammars.get(request_id)
        if grammar is None or not grammar.template.done():
            return None
        self._matcher(grammar)
        return grammar.error

    def remove(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)

    def has(self, request_id: str) -> bool:
        return request_id in self._grammars

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fill_pool.shutdown(wait=False, cancel_futures=True)

    # ---- compiling
    def _template(self, params: StructuredOutputsParams) -> Future:
        future = self._templates.get(params)
        if future is not None:
            self._templates.move_to_end(params)
            return future
        future = self._pool.submit(self._compile, params)
        self._templates[params] = future
        if len(self._templates) > MAX_CACHED_GRAMMARS:
            self._templates.popitem(last=False)
        return future

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            tokenizer = self._ll_tokenizer()
        except ValueError as exc:  # llguidance cannot read this tokenizer
            raise GrammarError(f"structured output is not available for this model's tokenizer: {exc}") from exc
        return compile_matcher(params, tokenizer)

    def _matcher(self, grammar: _RequestGrammar) -> llguidance.LLMatcher | None:
        """The request's matcher, made from its compiled template on first use and advanced over the tokens it
        already has (a decode instance's request arrives with its first token); waits for the compile."""
        if grammar.matcher is None and grammar.error is None:
            try:
                matcher = grammar.template.result().deep_copy()
            except GrammarError as exc:
                grammar.error = str(exc)
                return None
            if grammar.request.output_token_ids and not matcher.consume_tokens(grammar.request.output_token_ids):
                grammar.error = f"its tokens so far do not match the grammar: {matcher.get_error()}"
                return None
            grammar.matcher = matcher
        return grammar.matcher

    # ---- the step
    def fill_bitmask(self, plan: StepPlan, overlap: bool = True) -> None:
        """Set plan.grammar_bitmask to one row of allowed tokens (bit t of row i: token t may follow) for each
        constrained request that samples this step, and plan.grammar_request_ids to their request ids, in row
        order. With overlap the rows are filled on a thread while the step's forward pass runs, and
        plan.grammar_bitmask is the Future of the array until the sampler needs it (plan.grammar_bitmask_now)."""
        grammars = self._grammars
        rows = [grammars[s.request_id] for s in plan.scheduled if s.sample and s.request_id in grammars]
        if not rows:
            return
        plan.grammar_request_ids = [grammar.request.request_id for grammar in rows]
        plan.grammar_bitmask = self._fill_pool.submit(self._fill, rows) if overlap else self._fill(rows)

    def _fill(self, rows: list[_RequestGrammar]) -> np.ndarray:
        bitmask = np.full((len(rows), self.num_words), -1, dtype=np.int32)
        matchers = []
        for index, grammar in enumerate(rows):
            matcher = self._matcher(grammar)
            if matcher is None or matcher.is_error():
                self._only_eos(bitmask, index)
            else:
                matchers.append((matcher, index))
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0][0], bitmask, matchers[0][1])
        elif matchers:
            if self._mask_executor is None:
                self._mask_executor = llguidance.LLExecutor()
            fill_next_token_bitmask_par(self._mask_executor, matchers, bitmask)
        return bitmask

    def _only_eos(self, bitmask: np.ndarray, index: int) -> None:
        """A request whose grammar failed may only end."""
        bitmask[index] = 0
        for token_id in self._ll_tokenizer().eos_tokens:
            bitmask[index, token_id // 32] |= np.int32(np.uint32(1 << (token_id % 32)).view(np.int32))

    def accept_tokens(self, plan: StepPlan, result: StepResult) -> list[str]:
        """Advance the matchers of plan's constrained requests by their sampled tokens; the ids of those whose
        grammar is complete (nothing may follow) or failed, which are to stop."""
        plan.grammar_bitmask_now()  # the matchers are the fill's until it is done
        terminated = []
        for request_id in plan.grammar_request_ids:
            grammar = self._grammars.get(request_id)
            sampled = result.sampled.get(request_id)
            if grammar is None or sampled is None or grammar.matcher is None:
                if grammar is not None and grammar.error is not None:
                    terminated.append(request_id)
                continue
            matcher = grammar.matcher
            if not matcher.consume_token(sampled.token_id):
                logger.warning("request %s: token %d does not match its grammar: %s", request_id,
                               sampled.token_id, matcher.get_error())
            if matcher.is_stopped() or matcher.is_error():
                terminated.append(request_id)
        return terminated
