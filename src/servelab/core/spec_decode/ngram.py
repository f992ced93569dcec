"""Prompt lookup (vLLM's "ngram" method): the tokens that followed the longest n-gram ending the request's
tokens where it also occurs earlier in its prompt or output. Input-grounded outputs (summaries, code edits,
quotes) copy spans of the prompt, so the span after a match is often what the model writes next.

Each request keeps an index from every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to its earliest
start, grown by the tokens added since the last call, so a proposal costs O(max - min) dict lookups rather
than a scan of the context.

Adaptive draft length (SpeculativeConfig.draft_min_acceptance = theta > 0): each request keeps, for each draft
position i, a moving average p[i] of whether its drafts were right up to position i, and proposes only the
leading positions with p[i] >= theta: a verify row that is accepted less often than that costs more than it
gives. Whether a draft was right is read from the tokens the request goes on to output, whether the draft was
verified or not: the lookup is free, and greedy outputs do not depend on what was drafted, so a request that
stopped drafting still learns, at no cost, when its lookups would hit again (one draft is followed at a time,
until its first wrong token or its end). Deterministic: the same tokens give the same drafts."""
from __future__ import annotations

from servelab.config import SpeculativeConfig
from servelab.core.request import Request

ACCEPTANCE_WEIGHT = 0.5  # the moving average's weight of the newest draft: it follows the last two or three


class _NgramIndex:
    __slots__ = ("tokens", "first_start", "acceptance", "followed", "followed_start", "followed_matched")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.tokens: list[int] = []
        # (n-gram) -> its earliest start, over n-grams followed by at least one token
        self.first_start: dict[tuple[int, ...], int] = {}
        # adaptive drafting: p[i], the estimated chance that a draft is right up to position i (optimistic at
        # first); the draft being followed, where it starts in the tokens, and how many of its tokens were right
        self.acceptance = [1.0] * num_speculative_tokens
        self.followed: list[int] = []
        self.followed_start = self.followed_matched = 0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.min_acceptance = config.draft_min_acceptance
        self._indexes: dict[str, _NgramIndex] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        k = min(self.num_speculative_tokens, max_num_tokens)
        if k <= 0:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _NgramIndex(self.num_speculative_tokens)
        tokens = index.tokens
        old_len, new_len = len(tokens), request.num_tokens
        if new_len > old_len:
            tokens += request.token_ids_slice(old_len, new_len)
            self._index_ngrams(index, old_len, new_len)
        draft = self._lookup(index, new_len, k)
        if self.min_acceptance <= 0:
            return draft
        self._learn(index)
        if draft and not index.followed:
            index.followed, index.followed_start, index.followed_matched = draft, new_len, 0
        return draft[:self.draft_length(request.request_id)]

    def draft_length(self, request_id: str) -> int:
        """How many leading draft positions the request's acceptance estimates still pay for."""
        index = self._indexes.get(request_id)
        if index is None or self.min_acceptance <= 0:
            return self.num_speculative_tokens
        length = 0
        for p in index.acceptance:
            if p < self.min_acceptance:
                break
            length += 1
        return length

    def _lookup(self, index: _NgramIndex, new_len: int, k: int) -> list[int]:
        tokens, first_start = index.tokens, index.first_start
        for n in range(min(self.max_n, new_len - 1), self.min_n - 1, -1):
            start = first_start.get(tuple(tokens[new_len - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []

    @staticmethod
    def _learn(index: _NgramIndex) -> None:
        """Check the followed draft against the tokens output since: each position it got right moves p[i]
        towards 1; at its first wrong token, that position and the later ones move towards 0."""
        draft, tokens, acceptance = index.followed, index.tokens, index.acceptance
        start, matched = index.followed_start, index.followed_matched
        while matched < len(draft) and start + matched < len(tokens):
            if tokens[start + matched] != draft[matched]:
                for i in range(matched, len(draft)):
                    acceptance[i] -= ACCEPTANCE_WEIGHT * acceptance[i]
                index.followed = []
                return
            acceptance[matched] += ACCEPTANCE_WEIGHT * (1 - acceptance[matched])
            matched += 1
        index.followed_matched = matched
        if matched == len(draft):
            index.followed = []

    def _index_ngrams(self, index: _NgramIndex, old_len: int, new_len: int) -> None:
        """Enter the n-grams that now have a following token: those ending (exclusive) at old_len .. new_len - 1."""
        tokens, first_start = index.tokens, index.first_start
        for end in range(max(old_len, 1), new_len):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_start.setdefault(tuple(tokens[end - n:end]), end - n)

    def drop(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
