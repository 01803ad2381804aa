"""Prompt seeding (engine/tr/seeding.py) on tiny tensors: the docstring's example, chunk by chunk."""

import torch

from trserve.engine.tr.seeding import PromptSeeding


def test_seeding_takes_the_tail_after_a_cached_prefix_and_rows_per_chunk():
    ids = [7] * 12 + list(range(100, 128))  # 40 tokens; 7 repeats, so only its last position (11) seeds
    known = {115}  # a row the tenant's matrix already has

    seeding = PromptSeeding.plan(ids, done=10, n=32, known_rows=lambda tail: [t in known for t in tail])
    assert seeding.at == [11] + [q for q in range(12, 40) if ids[q] not in known]  # nothing before 10: cached
    assert seeding.in_chunk(10, 6) == [1, 2, 3, 4, 5] and seeding.in_chunk(40, 8) == []
    assert 27 not in seeding.at  # token 115: known
    logits = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # 8 positions, V = 6
    seeding.take(torch.tensor(ids[32:40]), logits, None, 2, lambda lg, top: torch.full(top.shape, 0.5))
    rows = seeding.take_rows()
    assert rows.tokens.tolist() == ids[32:40] and rows.topk.tolist() == [[5, 4]] * 8
    assert seeding.take_rows() is None and seeding.at  # consumed once; the positions stay readable


def test_a_token_seeds_once_at_its_last_position():
    seeding = PromptSeeding.plan([5, 7, 5, 9], done=0, n=4, known_rows=lambda tail: [False, False, False, True])
    assert seeding.at == [1, 2]  # 5's last occurrence and 7; 9 is known


def test_root_rows_take_the_forwards_rows_else_compute_them_from_each_roots_logits():
    from trserve.engine.tr.recycle import root_rows, top_probs

    logits = [torch.tensor([[0.0, 3.0, 1.0, 2.0], [9.0, 9.0, 9.0, 9.0]]), torch.tensor([[5.0, 1.0, 4.0, 0.0]])]
    computed = root_rows(logits, [None, None], [None, None], 2, top_probs)  # only each row 0 counts
    assert [ids.tolist() for ids, _ in computed] == [[1, 3], [0, 2]]
    assert torch.equal(computed[0][1], top_probs(logits[0][:1], computed[0][0][None])[0])
    tops = [torch.tensor([[7, 6]], dtype=torch.int32), torch.tensor([[5, 4]], dtype=torch.int32)]
    probs = [torch.tensor([[0.5, 0.25]]), torch.tensor([[0.75, 0.125]])]
    given = root_rows(logits, tops, probs, 2, top_probs)  # the forward's own, as they are
    assert [ids.tolist() for ids, _ in given] == [[7, 6], [5, 4]] and given[1][1].tolist() == [0.75, 0.125]
    assert root_rows([], [], [], 2, top_probs) == []
