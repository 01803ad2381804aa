"""Prompt lookup: continuations of the current suffix found earlier in the request's own tokens.

The adjacency matrix is first-order (one token of context), so it cannot know that a request is
copying a span of its input (translation, summarisation, RAG, code edits). An n-gram match over
prompt + output catches exactly that; `engine/tr/hybrid.py` hangs the proposal into the draft tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # the continuation after the match, at most `length` tokens
    ngram: int  # size of the matched suffix (longer = more reliable)


def find_continuation(context: np.ndarray, max_ngram: int, min_ngram: int, length: int) -> Proposal | None:
    """The tokens that followed the most recent earlier occurrence of the context's last n tokens.

    context: [T] int64. Tries n = max_ngram down to min_ngram; the first n with a match wins, and
    among its matches the most recent one (nearest text is the most likely to repeat).
    Example: context [1, 2, 3, 9, 1, 2], max_ngram 2, length 3: the suffix [1, 2] occurs at
    position 0, followed by [3, 9, 1] -> Proposal([3, 9, 1], ngram=2).
    """
    t = int(context.shape[0])
    for n in range(min(max_ngram, t - 1), min_ngram - 1, -1):
        suffix = context[t - n:]
        # windows over context[:-1] so that every match has at least one following token
        windows = np.lib.stride_tricks.sliding_window_view(context[: t - 1], n)  # [t - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return Proposal(tokens=context[start: start + length].tolist(), ngram=n)
    return None


class ContextLookup:
    """The request's tokens so far (prompt + committed output) in a growing buffer."""

    def __init__(self, prompt: list[int], capacity: int) -> None:
        self._buf = np.zeros(max(capacity, len(prompt)) + 1, dtype=np.int64)
        self._len = 0
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        end = self._len + len(tokens)
        if end > self._buf.shape[0]:
            self._buf = np.concatenate([self._buf, np.zeros(end, dtype=np.int64)])
        self._buf[self._len: end] = tokens
        self._len = end

    def propose(self, caps: tuple[int, ...]) -> Proposal | None:
        """A proposal cut to caps[n - 1] tokens for the longest suffix match size n (see TreeTemplate.lookup)."""
        usable = [n for n, c in enumerate(caps, start=1) if c > 0]
        if not usable or self._len < 2:
            return None
        found = find_continuation(self._buf[: self._len], len(caps), usable[0], max(caps))
        if found is None or caps[found.ngram - 1] == 0:
            return None
        return Proposal(found.tokens[: caps[found.ngram - 1]], found.ngram)
