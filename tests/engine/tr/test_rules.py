"""engine/tr/rules.py on tiny tensors: logit_bias adds to the named ids, min_tokens bans stop ids on
rows predicting positions before it, and a row's result never depends on the rows beside it."""

from __future__ import annotations

import torch

from trserve.engine.tr.rules import LogitRules
from trserve.engine.tr.sampling import choose


def test_bias_and_min_tokens_per_row_position() -> None:
    rules = LogitRules.of(((1, 5.0), (3, -100.0)), 2, frozenset({0}), "cpu")
    logits = torch.tensor([[3.0, 1.0, 2.0, 9.0], [3.0, 1.0, 2.0, 9.0], [3.0, 1.0, 2.0, 9.0]])  # [3, V=4]
    out = rules.apply(logits, torch.tensor([0, 1, 2]))
    assert out[:, 1].tolist() == [6.0, 6.0, 6.0] and out[:, 3].tolist() == [-91.0] * 3
    assert out[:2, 0].tolist() == [float("-inf")] * 2 and out[2, 0] == 3.0  # id 0 (a stop) from position 2 on
    assert choose(logits, None, torch.tensor([0, 1, 2]), topk=torch.tensor([[3], [3], [3]]), rules=rules).tolist() \
        == [1, 1, 1]  # the forward's top-k is not the choice under rules
    alone = rules.apply(logits[2:], torch.tensor([2]))
    assert torch.equal(alone, out[2:])
    assert LogitRules.of((), 5, frozenset(), "cpu") is None and LogitRules.of((), 0, frozenset({2}), "cpu") is None
