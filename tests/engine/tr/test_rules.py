"""engine/tr/rules.py on tiny tensors: logit_bias adds to the named ids, min_tokens bans stop ids on
rows predicting positions before it, penalties read each row's own tokens before it (a tree node's:
the output plus its path), and a row's result never depends on the rows beside it."""

from __future__ import annotations

import torch

from trserve.engine.request.request import GenerationRequest
from trserve.engine.tr.rules import LogitRules
from trserve.engine.tr.sampling import choose, choose_in_tree
from trserve.engine.tr.tree import TreeTemplate, get_compiled


def _rules(prompt=(5,), **kwargs) -> LogitRules | None:
    return LogitRules.of(GenerationRequest(input_ids=list(prompt), max_new_tokens=8, **kwargs), frozenset({0}),
                         prompt, "cpu")


def test_bias_and_min_tokens_per_row_position() -> None:
    rules = _rules(logit_bias=((1, 5.0), (3, -100.0)), min_tokens=2)
    logits = torch.tensor([[3.0, 1.0, 2.0, 9.0], [3.0, 1.0, 2.0, 9.0], [3.0, 1.0, 2.0, 9.0]])  # [3, V=4]
    out = rules.apply(logits, torch.tensor([0, 1, 2]))
    assert out[:, 1].tolist() == [6.0, 6.0, 6.0] and out[:, 3].tolist() == [-91.0] * 3
    assert out[:2, 0].tolist() == [float("-inf")] * 2 and out[2, 0] == 3.0  # id 0 (a stop) from position 2 on
    assert choose(logits, None, torch.tensor([0, 1, 2]), topk=torch.tensor([[3], [3], [3]]), rules=rules).tolist() \
        == [1, 1, 1]  # the forward's top-k is not the choice under rules
    assert torch.equal(rules.apply(logits[2:], torch.tensor([2])), out[2:])
    assert _rules() is None and _rules(min_tokens=0) is None and not _rules(min_tokens=3).reads_context


def test_penalties_read_each_rows_tokens_before_it() -> None:
    rules = _rules(prompt=(2,), repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert rules.reads_context
    logits = torch.tensor([[4.0, -4.0, 4.0, 1.0], [4.0, -4.0, 4.0, 1.0]])
    out = rules.apply(logits, 0, [[0, 0, 1], []])
    # row 0: ids 0 (twice), 1 (once) in its output, 2 in the prompt: repetition on 0, 1, 2; then counts
    assert out[0].tolist() == [4 / 2 - 0.5 * 2 - 0.25, -4 * 2 - 0.5 - 0.25, 4 / 2, 1.0]
    assert out[1].tolist() == [4.0, -4.0, 2.0, 1.0]  # only the prompt's id 2
    assert torch.equal(rules.apply(logits[1:], 0, [[]]), out[1:])


def test_a_tree_node_is_penalised_by_its_own_path() -> None:
    """Node 3 (path 0 -> 1 -> 3) sees the output plus node 1's token; node 2 (a child of the root)
    sees the output only. Frequency penalty 3 on a row that would pick the repeated token flips it."""
    tree = get_compiled(TreeTemplate.from_paths("t", [[0], [1], [0, 0]]), "cpu", torch.float32)  # parents 0, 0, 1
    tokens = torch.tensor([9, 1, 2, 1])  # root 9; node 1 = 1, node 2 = 2, node 3 = 1
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0], [0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])  # V = 3
    rules = _rules(prompt=(0,), frequency_penalty=2.0)
    picked = choose_in_tree(logits, tokens, tree, None, 0, None, rules, generated=[])
    # root: no output yet -> 1 (matches node 1); node 1: output [1] -> 5 - 2 = 3 < 4 -> 2
    assert picked[0] == 1 and picked[1] == 2 and picked[2] == -1  # node 2 is unreachable: never chosen
