"""Confidence buckets beside matrix ids: encoding, recycling and the matrix's write rule."""

import numpy as np
import torch

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.confidence import decode, encode
from trserve.engine.tr.matrix import AdjacencyMatrix
from trserve.engine.tr.recycle import RecycledRows, recycle_rows


def test_encode_decode_numpy_and_torch_agree():
    p = [0.0, 1e-4, 0.05, 0.5, 0.9, 1.0]
    q_np, q_t = encode(np.array(p)), encode(torch.tensor(p))
    assert q_np.dtype == np.uint8 and q_t.dtype == torch.uint8
    assert q_np.tolist() == q_t.tolist() == [0, 0, 13, 128, 230, 255]
    assert np.allclose(decode(q_np), np.array(q_np, dtype=np.float32) / 255)
    assert torch.allclose(decode(q_t), q_t.float() / 255)


def test_recycled_probs_are_the_softmax_of_the_recycled_ids():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.5, 3.0, 0.0, -0.5]])  # [2, V=4]
    rows = recycle_rows(torch.tensor([5, 6]), logits, 2, accepted_path=[0])
    assert rows.topk.tolist() == [[0, 2], [1, 0]]
    soft = torch.softmax(logits, -1)
    expect = [[soft[0, 0], soft[0, 2]], [soft[1, 1], soft[1, 0]]]
    assert rows.probs.tolist() == encode(torch.tensor(expect)).tolist()


def test_matrix_apply_writes_probs_and_zeroes_unknown_ones():
    spec = ModelSpec(fingerprint="f" * 16, vocab_size=8, k=2)
    m = AdjacencyMatrix(spec)
    m.apply(RecycledRows(torch.tensor([3]), torch.tensor([[1, 2]], dtype=torch.int32),
                         torch.tensor([[200, 30]], dtype=torch.uint8)))
    assert m.probs[3].tolist() == [200, 30]
    m.apply(RecycledRows(torch.tensor([3]), torch.tensor([[4, 5]], dtype=torch.int32)))  # an ids-only peer
    assert m.rows[3].tolist() == [4, 5] and m.probs[3].tolist() == [0, 0]


def test_blended_averages_each_new_confidence_with_the_old_one_of_the_same_successor():
    spec = ModelSpec("fp", 16, 2)
    m = AdjacencyMatrix(spec)
    m.apply(RecycledRows(torch.tensor([4, 5]), torch.tensor([[7, 9], [1, 2]], dtype=torch.int32),
                         torch.tensor([[200, 40], [0, 0]], dtype=torch.uint8)))  # 5: ids without confidences
    new = RecycledRows(torch.tensor([4, 5, 6]), torch.tensor([[9, 3], [2, 1], [8, 7]], dtype=torch.int32),
                       torch.tensor([[180, 60], [90, 11], [33, 255]], dtype=torch.uint8))
    out = m.blended(new)
    # 4: 9 was at 40 -> (180 + 40) / 2, 3 was absent -> 60 / 2; 5 and 6 had no confidences: kept as they are
    assert out.probs.tolist() == [[110, 30], [90, 11], [33, 255]]
    assert out.topk is new.topk and out.tokens is new.tokens and out.probs.dtype == torch.uint8
    assert m.blended(RecycledRows(new.tokens, new.topk)).probs is None  # ids only: nothing to blend
    odd = m.blended(RecycledRows(torch.tensor([4]), torch.tensor([[7, 1]], dtype=torch.int32),
                                 torch.tensor([[1, 2]], dtype=torch.uint8)))
    assert odd.probs.tolist() == [[100, 1]]  # halves round to even: (1 + 200) / 2 = 100.5 -> 100, 2 / 2 = 1


def test_host_views_share_the_matrix_memory_and_are_made_once():
    m = AdjacencyMatrix(ModelSpec("fp", 6, 2))
    rows, probs = m.host_views()
    assert rows.shape == probs.shape == (6, 2) and m.host_views()[0] is rows
    m.apply(RecycledRows(torch.tensor([4]), torch.tensor([[5, 1]]), torch.tensor([[200, 30]], dtype=torch.uint8)))
    assert rows[4].tolist() == [5, 1] and probs[4].tolist() == [200, 30]  # written through


def test_recycled_rows_take_the_forwards_own_confidences_with_their_winning_rows():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.5, 3.0, 0.0, -0.5], [0.0, 0.0, 4.0, 1.0]])  # [3, V=4]
    topk = torch.topk(logits, 2).indices.to(torch.int32)  # as the forward gives them
    known = torch.tensor([[11, 12], [21, 22], [31, 32]], dtype=torch.uint8)  # not the softmax: must be taken as is
    rows = recycle_rows(torch.tensor([5, 6, 5]), logits, 2, accepted_path=[0, 1], topk=topk, probs=known)
    assert sorted(zip(rows.tokens.tolist(), rows.probs.tolist())) == [(5, [11, 12]), (6, [21, 22])]  # path row wins
    plain = recycle_rows(torch.tensor([5, 6]), logits[:2], 2, accepted_path=[0], topk=topk[:2], probs=known[:2])
    assert plain.probs is known[:2] or plain.probs.tolist() == [[11, 12], [21, 22]]
