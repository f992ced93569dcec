"""Prompt lookup (vLLM's "ngram" method): the tokens that followed the longest n-gram ending the request's
tokens where it also occurs earlier in its prompt or output. Input-grounded outputs (summaries, code edits,
quotes) copy spans of the prompt, so the span after a match is often what the model writes next.

Each request keeps an index from every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to its earliest
start, grown by the tokens added since the last call, so a proposal costs O(max - min) dict lookups rather
than a scan of the context."""
from __future__ import annotations

from servelab.config import SpeculativeConfig
from servelab.core.request import Request


class _NgramIndex:
    __slots__ = ("tokens", "first_start")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # (n-gram) -> its earliest start, over n-grams followed by at least one token
        self.first_start: dict[tuple[int, ...], int] = {}


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_num_tokens)
        if k <= 0:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _NgramIndex()
        tokens = index.tokens
        old_len, new_len = len(tokens), request.num_tokens
        if new_len > old_len:
            tokens += request.token_ids_slice(old_len, new_len)
            self._index_ngrams(index, old_len, new_len)
        first_start = index.first_start
        for n in range(min(self.max_n, new_len - 1), self.min_n - 1, -1):
            start = first_start.get(tuple(tokens[new_len - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []

    def _index_ngrams(self, index: _NgramIndex, old_len: int, new_len: int) -> None:
        """Enter the n-grams that now have a following token: those ending (exclusive) at old_len .. new_len - 1."""
        tokens, first_start = index.tokens, index.first_start
        for end in range(max(old_len, 1), new_len):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_start.setdefault(tuple(tokens[end - n:end]), end - n)

    def drop(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
