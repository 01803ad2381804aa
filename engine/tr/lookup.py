"""Prompt lookup: continuations of the current suffix found earlier in the request's own tokens.

The adjacency matrix is first-order (one token of context), so it cannot know that a request is
copying a span of its input (translation, summarisation, RAG, code edits). An n-gram match over
prompt + output catches exactly that; `engine/drafting/hybrid.py` hangs the proposal into the draft tree.
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
    """The request's tokens so far (prompt + committed output), with an index of their n-grams so a
    step's lookup costs one dict probe per n instead of a scan of the context (the same answer as
    `find_continuation` over the whole context: the tests check it).

    `_index[n - 1]` maps each n-gram that has a following token to the start of its most recent
    occurrence; appending a token adds, for every indexed n, the n-gram that token now follows.
    Sizes up to `max_ngram` are indexed at once, larger ones when a lookup first asks for them."""

    def __init__(self, prompt: list[int], max_ngram: int = 0) -> None:
        self._tokens: list[int] = []
        self._index: list[dict[tuple[int, ...], int]] = []
        self.extend(prompt)
        self._ensure(max_ngram)

    def __len__(self) -> int:
        return len(self._tokens)

    def _ensure(self, max_ngram: int) -> None:
        toks = self._tokens
        while len(self._index) < max_ngram:
            n = len(self._index) + 1
            m = max(len(toks) - n, 0)  # n-grams with a following token start at 0 .. m - 1
            # the n-grams built by zip over shifted slices (in C), the later start winning a repeated one:
            # a 600-token prompt's 8 sizes took ~1.4 ms as a comprehension of slices, ~0.4 ms so
            self._index.append(dict(zip(zip(*(toks[i: i + m] for i in range(n))), range(m))))

    def extend(self, tokens: list[int]) -> None:
        toks = self._tokens
        old = len(toks)
        toks.extend(int(t) for t in tokens)
        for n, index in enumerate(self._index, start=1):
            # n-grams starting at s with a following token: s + n <= len - 1; new ones start at old - n ...
            for s in range(max(old - n, 0), len(toks) - n):
                index[tuple(toks[s: s + n])] = s

    def tail(self, n: int) -> list[int]:
        """The last `n` tokens (all of them when there are fewer)."""
        return self._tokens[-n:]

    def propose(self, caps: tuple[int, ...]) -> Proposal | None:
        """A proposal cut to caps[n - 1] tokens for the longest suffix match size n (see TreeTemplate.lookup);
        None when there is none, or when the longest match has cap 0 (smaller ones are not tried)."""
        usable = [n for n, c in enumerate(caps, start=1) if c > 0]
        toks = self._tokens
        t = len(toks)
        if not usable or t < 2:
            return None
        self._ensure(len(caps))
        # shortest first, to the first size absent: an earlier occurrence of the (n + 1)-token suffix ends
        # with one of the n-token suffix, so the sizes present are 1..longest (most steps match 1-3 tokens:
        # 2-4 probes, where longest first took len(caps))
        longest, at = 0, 0
        for n in range(1, min(len(caps), t - 1) + 1):
            s = self._index[n - 1].get(tuple(toks[t - n:]))
            if s is None:
                break
            longest, at = n, s
        if longest < usable[0] or caps[longest - 1] == 0:
            return None
        return Proposal(toks[at + longest: at + longest + caps[longest - 1]], longest)
