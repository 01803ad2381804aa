"""Log-probabilities of committed tokens, from the logits row that chose each one.

`token_logprob(row, token, top)`: the log-softmax of `row` [V] at `token`, and the `top` most likely
ids with theirs. Computed in float64 with numpy on that one row alone (max, then a pairwise sum of
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
    x = row.detach().to("cpu", torch.float64).numpy()  # [V]
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x - m))))  # log-sum-exp; NaN where the row has a NaN
    pairs: tuple[tuple[int, float], ...] = ()
    if top:
        ids = np.argsort(-x, kind="stable")[:top]  # stable: equal logits by lower id
        pairs = tuple((int(i), float(x[i] - lse)) for i in ids)
    return TokenLogprob(int(token), float(x[token] - lse), pairs)


def record_logprobs(seq, rows: torch.Tensor, kept: list[int], at: list[int] | None = None) -> list[int]:
    """The kept tokens' log-probabilities onto `seq.logprobs`, where its request asked for them: rows
    [n, V] of logits, row at[i] (i without `at`) the one that chose kept[i]. Returns `kept`."""
    if seq.logprobs is not None:
        top = seq.prepared.request.logprobs
        seq.logprobs.extend(token_logprob(rows[at[i] if at else i], token, top) for i, token in enumerate(kept))
    return kept


def record_prompt_logprobs(seq, rows: torch.Tensor, tokens) -> None:
    """Prompt tokens' log-probabilities onto `seq.prompt_logprobs`: row q of `rows` predicted tokens[q]."""
    top = seq.prepared.request.prompt_logprobs
    seq.prompt_logprobs.extend(token_logprob(rows[q], int(token), top) for q, token in enumerate(tokens))
