"""Log-probabilities many rows at once (engine/tr/logprobs.py): each row's numbers are the same bits as
that row's alone (so TR's, scored in gathered rows, equal plain decoding's, one row a step), and the
top ids are the stable sort's: most likely first, equal logits by lower id."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trserve.engine.tr.logprobs import token_logprobs


@pytest.mark.parametrize("vocab", [49152, 32001, 7])
def test_rows_together_equal_rows_alone(vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    rows = torch.randn(9, vocab, generator=g) * 4
    rows[2, 3:6] = rows[2].max() + 1  # a tie at the top: lower ids first
    tokens = torch.randint(0, vocab, (9,), generator=g).tolist()
    top = min(20, vocab)
    together = token_logprobs(rows, tokens, top)
    for i in range(9):
        alone = token_logprobs(rows[i: i + 1], tokens[i: i + 1], top)[0]
        assert together[i] == alone  # the same floats, bit for bit
        x = rows[i].double().numpy()
        lse = x.max() + np.log(np.sum(np.exp(x - x.max())))
        want = np.argsort(-x, kind="stable")[:top]
        assert [t for t, _ in alone.top] == want.tolist() and alone.logprob == float(x[tokens[i]] - lse)
    assert [t for t, _ in together[2].top[:3]] == [3, 4, 5]


def test_no_top_and_a_nan_row() -> None:
    rows = torch.zeros(2, 5)
    rows[1, 2] = float("nan")
    out = token_logprobs(rows, [1, 2], 0)
    assert out[0].top == () and out[0].logprob == pytest.approx(-np.log(5))
    assert np.isnan(out[1].logprob)
    nan_top = token_logprobs(rows, [1, 2], 3)[1].top  # a NaN row has no ordering to trust: no failure either
    assert len(nan_top) <= 3 and all(np.isnan(v) for _, v in nan_top)
