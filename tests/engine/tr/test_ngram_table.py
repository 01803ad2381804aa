"""The n-gram hash table under the suffix history: insertion keeps each n-gram's most recent position,
whether a round of numpy moves it or the one-by-one finish does, and the hash chain agrees with numpy's."""

import numpy as np
import pytest

from trserve.engine.tr.ngram_table import doc_hashes, insert, mix, probe


def _find(table, buf, n, h, gram):
    row = table[0]
    slot, stride = probe(h, row.shape[0] - 1)
    while (pos := int(row[slot])) >= 0:
        if buf[pos - n: pos].tolist() == gram:
            return pos
        slot = (slot + stride) & (row.shape[0] - 1)
    return -1


def test_scalar_and_array_hash_chains_agree():
    doc = np.array([5, 9, 9, 2, 7], np.int32)
    hashes = doc_hashes(doc, 3)  # per n: the hash of doc[s: s + n]
    h = 0
    for n in range(1, 4):
        h = mix(h, int(doc[5 - n]))  # prepend: the suffix of length n ending at doc[4]
        assert int(hashes[n - 1][5 - n]) == h


@pytest.mark.parametrize("count", [5, 400])  # the one-by-one finish alone; numpy rounds first
def test_insert_keeps_the_most_recent_position_of_every_ngram(count):
    rng = np.random.default_rng(count)
    n = 2
    buf = rng.integers(0, 6, count + n + 1).astype(np.int32)  # few symbols: many repeats and collisions
    table = np.full((1, 1024), -1, np.int32)
    hashes = doc_hashes(buf, n)[n - 1]  # hash of buf[s: s + 2] at s
    vals = np.arange(n, count + n, dtype=np.int64)  # the position after each 2-gram: s + 2
    order = rng.permutation(count)  # any batch order: the larger position still wins
    insert(table, buf, np.zeros(count, np.int64), np.full(count, n), hashes[vals - n][order], vals[order])
    latest = {}
    for v in vals.tolist():
        latest[tuple(buf[v - n: v].tolist())] = v
    for gram, v in latest.items():
        h = mix(mix(0, gram[1]), gram[0])
        assert _find(table, buf, n, h, list(gram)) == v
    assert int((table >= 0).sum()) == len(latest)
