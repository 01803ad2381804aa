"""Drafting, acceptance and recycling on tiny tensors."""

import torch

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.accept import accept_greedy
from trserve.engine.tr.draft import draft_tokens
from trserve.engine.tr.matrix import AdjacencyMatrix
from trserve.engine.tr.recycle import RecycledRows, distinct_rows, recycle_rows, seed_positions, select_rows
from trserve.engine.tr.tree import TreeTemplate, compile_tree

TREE = compile_tree(TreeTemplate.from_paths("ex", [[0], [1], [0, 0]]))


def test_draft_one_gather_per_level():
    m = torch.zeros(10, 2, dtype=torch.int32)
    m[5] = torch.tensor([7, 9])
    m[7] = torch.tensor([3, 4])
    assert draft_tokens(m, 5, TREE).tolist() == [5, 7, 9, 3]


def test_draft_cold_matrix_drafts_zeros():
    assert draft_tokens(torch.zeros(10, 2, dtype=torch.int32), 4, TREE).tolist() == [4, 0, 0, 0]


def test_accept_longest_path_and_bonus():
    tokens = torch.tensor([5, 7, 9, 3])
    acc = accept_greedy(tokens, torch.tensor([7, 3, 1, 8]), TREE)
    assert acc.path == [0, 1, 3] and acc.tokens == [7, 3, 8]


def test_accept_nothing_gives_bonus_only():
    acc = accept_greedy(torch.tensor([5, 7, 9, 3]), torch.tensor([2, 3, 1, 8]), TREE)
    assert acc.path == [0] and acc.tokens == [2]


def test_accept_child_of_rejected_parent_is_not_accepted():
    # node 3 (child of node 1) would match greedy[1], but node 1 itself does not match greedy[0]
    acc = accept_greedy(torch.tensor([5, 7, 9, 3]), torch.tensor([9, 3, 6, 8]), TREE)
    assert acc.path == [0, 2] and acc.tokens == [9, 6]


def test_accept_tie_prefers_higher_rank():
    t = compile_tree(TreeTemplate.from_paths("t", [[0], [1]]))
    acc = accept_greedy(torch.tensor([1, 4, 4]), torch.tensor([4, 5, 6]), t)
    assert acc.path == [0, 1] and acc.tokens == [4, 5]


def test_select_rows_rule():
    # token 5 at nodes 0 and 3, token 7 at nodes 1 and 2; accepted path [0, 2]
    winners = select_rows(torch.tensor([5, 7, 7, 5]), [0, 2]).tolist()
    assert sorted(winners) == [0, 2]
    # no node on the path: the earliest (shallowest, highest-ranked) wins
    assert sorted(select_rows(torch.tensor([5, 7, 7, 5]), [0]).tolist()) == [0, 1]
    # the path holds a token twice: the deeper one wins
    assert select_rows(torch.tensor([5, 5, 5]), [0, 1]).tolist() == [1]
    # no token repeated: no winners to gather (every row is kept); repeated: the same rule
    assert distinct_rows(torch.tensor([5, 7, 9]), [0, 2]) is None
    assert distinct_rows(torch.tensor([5, 7, 7, 5]), [0, 2]).tolist() == select_rows(torch.tensor([5, 7, 7, 5]), [0, 2]).tolist()


def test_seed_positions_skip_known_rows_and_earlier_repeats():
    # the docstring's example: 5's last occurrence and 7; 9's row is known
    assert seed_positions([5, 7, 5, 9], [False, False, False, True]) == [1, 2]
    # a repeat whose last occurrence is known is not seeded at an earlier position either
    assert seed_positions([5, 7, 5], [False, False, True]) == [1]
    assert seed_positions([3, 4], [False, False]) == [0, 1]
    assert seed_positions([3, 4], [True, True]) == []
    assert seed_positions([], []) == []


def test_recycle_and_apply():
    logits = torch.tensor([[0.0, 3, 1, 2], [5, 0, 1, 0], [0, 0, 9, 8], [1, 2, 3, 4]])
    rows = recycle_rows(torch.tensor([2, 3, 3, 0]), logits, 2, [0, 2])
    got = {t: r for t, r in zip(rows.tokens.tolist(), rows.topk.tolist())}
    assert got == {2: [1, 3], 3: [2, 3], 0: [3, 2]}
    m = AdjacencyMatrix(ModelSpec("fp", 4, 2))
    assert m.apply(rows) == 1
    assert m.rows.tolist() == [[3, 2], [0, 0], [1, 3], [2, 3]]
    assert "tokens=(3,)" in repr(rows) and isinstance(rows, RecycledRows)


def test_host_and_tensor_rules_agree_on_random_trees():
    """accept_greedy and select_rows run on Python ints for host tensors and as tensor ops on a
    device; both must give the same answer (here: random trees, chains, small vocabularies)."""
    from trserve.engine.tr.accept import _accept_host, _accept_tensor
    from trserve.engine.drafting.hybrid import attach_chain
    from trserve.engine.tr.recycle import _select_host, _select_tensor

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        paths, frontier = [], [()]
        for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
            parent = frontier[int(torch.randint(0, len(frontier), (1,), generator=g))]
            rank = sum(1 for p in paths if p[:-1] == parent)
            paths.append(parent + (rank,))
            frontier.append(paths[-1])
        tree = compile_tree(TreeTemplate.from_paths(f"r{trial}", [list(p) for p in paths]))
        if trial % 2:
            tree = attach_chain(tree, int(torch.randint(0, tree.n, (1,), generator=g)), int(trial % 5) + 1)
        vocab = int(torch.randint(2, 5, (1,), generator=g))
        tokens = torch.randint(0, vocab, (tree.n,), generator=g)
        greedy = torch.randint(0, vocab, (tree.n,), generator=g)
        a, b = _accept_host(tokens.tolist(), greedy.tolist(), tree), _accept_tensor(tokens, greedy, tree)
        assert (a.path, a.tokens) == (b.path, b.tokens), trial
        assert _select_host(tokens.tolist(), a.path) == _select_tensor(tokens, a.path).tolist(), trial
