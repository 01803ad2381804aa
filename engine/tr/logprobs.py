"""Log-probabilities of committed tokens, from the logits row that chose each one.

`token_logprobs(rows, tokens, top)`: the log-softmax of each row [V] at its token, and the `top` most
likely ids with theirs. Computed in float64 with numpy along each row (max, then a pairwise sum of
exp over the row in index order), so the numbers depend only on the row's bits, never on the batch
or tree the row was verified in: TR's logprobs equal plain decoding's, bit for bit, wherever its
rows do (the native forward's contract). Ties in `top` go to the lower id, as the forward's top-k."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP = 20  # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


def token_logprob(row: torch.Tensor, token: int, top: int = 0) -> TokenLogprob:
    """row: [V] logits -> the token's log-probability and the `top` (0..20) most likely ids'."""
    return token_logprobs(row[None], [token], top)[0]


def token_logprobs(rows: torch.Tensor, tokens, top: int = 0) -> list[TokenLogprob]:
    """rows: [n, V] logits, tokens [n] -> each row's token's log-probability and its `top` (0..20) most
    likely ids', computed for all rows at once and each row's numbers from its own bits alone (the
    reductions run along each row; tests/engine/tr/test_logprobs.py checks them against one row at a
    time). The top ids come from a partition, not a sort of the row: the ids at or above the top-th
    largest logit, most likely first, equal logits by lower id."""
    x = rows.detach().to("cpu", torch.float64).numpy()  # [n, V]
    m = np.max(x, axis=1)  # [n]
    lse = m + np.log(np.sum(np.exp(x - m[:, None]), axis=1))  # [n] log-sum-exp; NaN where a row has one
    picked = x[np.arange(len(x)), np.asarray(tokens, dtype=np.int64)] - lse  # [n]
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(x)
    if top:
        top = min(top, x.shape[1])
        kth = np.partition(x, -top, axis=1)[:, -top]  # [n] the top-th largest logit of each row
        rows_at, ids = np.nonzero(x >= kth[:, None])  # row-major: each row's candidates by ascending id
        starts = np.searchsorted(rows_at, np.arange(len(x) + 1))
        for r in range(len(x)):
            cand = ids[starts[r]: starts[r + 1]]  # >= top of them (more where logits tie at kth)
            best = cand[np.argsort(-x[r, cand], kind="stable")[:top]]
            tops[r] = tuple((int(i), float(x[r, i] - lse[r])) for i in best)
    return [TokenLogprob(int(t), float(p), tp) for t, p, tp in zip(tokens, picked, tops)]


def record_logprobs(seq, rows: torch.Tensor, kept: list[int], at: list[int] | None = None) -> list[int]:
    """The kept tokens' log-probabilities onto `seq.logprobs`, where its request asked for them: rows
    [n, V] of logits, row at[i] (i without `at`) the one that chose kept[i]. Returns `kept`."""
    if seq.logprobs is not None:
        top = seq.prepared.request.logprobs
        if kept:
            index = torch.tensor(at[: len(kept)] if at else list(range(len(kept))), device=rows.device)
            seq.logprobs.extend(token_logprobs(rows[index], kept, top))
    return kept


def record_prompt_logprobs(seq, rows: torch.Tensor, tokens) -> None:
    """Prompt tokens' log-probabilities onto `seq.prompt_logprobs`: row q of `rows` predicted tokens[q]."""
    top = seq.prepared.request.prompt_logprobs
    tokens = [int(t) for t in tokens]
    if tokens:
        seq.prompt_logprobs.extend(token_logprobs(rows[: len(tokens)], tokens, top))
