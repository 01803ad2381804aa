"""SuffixHistory on tiny worked examples, and against a brute-force scan of the documents it keeps."""

import random
import threading

import pytest

from trserve.engine.tr.history import SuffixHistory
from trserve.engine.tr.lookup import Proposal


def _history(*docs, **kw) -> SuffixHistory:
    kw.setdefault("min_ngram", 2)
    h = SuffixHistory(**kw)
    for d in docs:
        h.add(d)
    return h


def test_longest_match_wins_over_a_more_recent_shorter_one():
    h = _history([1, 2, 3, 4, 5], [9, 3, 7])  # [3] alone is newer, but [2, 3] is longer
    assert h.propose([8, 2, 3], 4) == Proposal([4, 5], 2)
    assert _history([1, 2, 3, 4, 5], [9, 2, 3, 7]).propose([8, 2, 3], 4) == Proposal([7], 2)


def test_most_recent_occurrence_wins():
    h = _history([5, 1, 2, 3, 4], [1, 2, 3, 9, 1, 2, 3, 6])
    assert h.propose([7, 1, 2, 3], 5) == Proposal([6], 3)  # the later of two in the newest document
    assert _history([1, 2, 3, 9], [5, 1, 2, 3, 4]).propose([1, 2, 3], 1) == Proposal([4], 3)


def test_no_match_across_documents_or_without_a_following_token():
    h = _history([4, 1, 2], [3, 8, 8])  # [1, 2, 3] spans the boundary; [1, 2] ends its document
    assert h.propose([1, 2], 3) is None and h.propose([0, 1, 2, 3], 3) is None
    h = _history([4, 1, 2, 3, 7])
    assert h.propose([1, 2, 3], 9) == Proposal([7], 3)  # cut at its document's end
    assert h.propose([1, 2, 3], 0) is None and h.propose([2], 3) is None  # nothing asked; context < min_ngram


def test_length_cut_and_only_the_last_max_ngram_tokens_count():
    h = _history([1, 2, 3, 4, 5, 6, 7, 8], max_ngram=3)
    assert h.propose([1, 2, 3], 2) == Proposal([4, 5], 3)
    assert h.propose([9, 9, 9, 9, 1, 2, 3], 3) == Proposal([4, 5, 6], 3)  # ngram capped at max_ngram


def test_eviction_keeps_the_newest_documents():
    h = _history([1, 2, 3, 4], [5, 6, 7, 8], max_tokens=8)
    h.add([9, 9, 9])  # 11 > 8: the oldest document goes
    assert (h.documents, h.tokens, h.version) == (2, 7, 3)
    assert h.propose([1, 2, 3], 1) is None and h.propose([5, 6], 2) == Proposal([7, 8], 2)
    h.add(list(range(20, 40)))  # longer than max_tokens: its last 8 tokens only, everything else goes
    assert (h.documents, h.tokens) == (1, 8)
    assert h.propose([32, 33], 9) == Proposal([34, 35, 36, 37, 38, 39], 2) and h.propose([30, 31], 1) is None


def test_serialisation_round_trip():
    h = _history([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 9])
    back = SuffixHistory.from_bytes(h.to_bytes(), min_ngram=2)
    assert (back.documents, back.tokens, back.version) == (3, 12, 3)
    assert back.propose([1, 2, 3], 3) == Proposal([9], 3) and back.propose([5, 6], 3) == Proposal([7, 8], 2)
    small = SuffixHistory.from_bytes(h.to_bytes(), max_tokens=9, min_ngram=2)  # the newest that fit
    assert (small.documents, small.tokens) == (2, 8) and small.propose([1, 2], 5) == Proposal([3, 9], 2)
    assert SuffixHistory.from_bytes(SuffixHistory().to_bytes()).tokens == 0


def test_adds_index_in_place_and_a_state_read_before_an_add_never_answers_from_it():
    h = _history([1, 2, 3, 4], [7, 7, 7], max_tokens=1000)
    before = h._state
    h.add([1, 2, 3, 9])  # [2, 3] and [1, 2, 3] now point at this newer occurrence, in the same tables
    assert h._state.young.table is before.young.table  # no copy of the index
    assert h.propose([1, 2, 3], 1) == Proposal([9], 3)
    h._state = before  # a reader that took its state before the add: the newer slots are past its tokens
    assert h.propose([1, 2, 3], 1) is None and h.propose([7, 7], 1) == Proposal([7], 2)


def test_the_younger_generation_turns_older_and_the_older_one_goes_whole():
    h = _history([1, 2, 3, 4], [5, 6, 7], max_tokens=20)  # generations of up to 10 tokens
    h.add([8, 9, 10, 11])  # 11 > 10: [1..4] and [5..7] become the older generation
    assert h._state.old.ends == (4, 7) and (h.documents, h.tokens) == (3, 11)
    h.add([12, 13, 14, 15, 16, 17, 18])  # 4 + 7 > 10: the older generation goes, with room left for it
    assert (h.documents, h.tokens) == (2, 11) and h.propose([1, 2], 1) is None
    assert h.propose([9, 10], 1) == Proposal([11], 2) and h.propose([13, 14], 2) == Proposal([15, 16], 2)


def test_a_full_history_holds_two_generations_of_tables_at_most():
    rng = random.Random(1)
    h = SuffixHistory(max_tokens=4096, max_ngram=4, min_ngram=2)  # generations of 2048 tokens
    for _ in range(200):
        h.add([rng.randrange(1000) for _ in range(rng.randrange(50, 150))])
        gens = [g for g in (h._state.old, h._state.young) if g is not None]
        assert all(g.table.shape[1] * 0.75 <= 2 * 2048 for g in gens)  # never a table for twice a generation
    assert 2048 <= h.tokens <= 4096 and h.memory_bytes() <= 2 * (3 * 4096 * 4 + 4096 * 4) + 40 * 200 + 512


def test_corrupt_or_truncated_blob_is_refused():
    blob = _history([1, 2, 3, 4], [5, 6, 7]).to_bytes()
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    for bad in (b"", blob[:10], blob[:-1], bytes(flipped), b"XXXX" + blob[4:], blob + b"\0"):
        with pytest.raises(ValueError):
            SuffixHistory.from_bytes(bad)


def test_bad_token_ids_are_refused():
    with pytest.raises(ValueError):
        SuffixHistory().add([1, -2, 3])


def _brute(docs, context, max_ngram, min_ngram, length):
    t = len(context)
    for n in range(min(max_ngram, t), min_ngram - 1, -1):
        suffix = context[t - n:]
        for doc in reversed(docs):
            for s in range(len(doc) - n - 1, -1, -1):
                if doc[s: s + n] == suffix:
                    return Proposal(doc[s + n: s + n + length], n)
    return None


@pytest.mark.parametrize("seed", range(6))
def test_matches_a_brute_force_scan(seed):
    rng = random.Random(seed)
    max_tokens, max_ngram, min_ngram = rng.choice([(60, 5, 2), (300, 8, 3), (2000, 12, 3)])
    vocab = rng.choice([3, 6, 50])
    h = SuffixHistory(max_tokens, max_ngram, min_ngram)
    old: dict[int, list[int]] = {}  # the two generations' documents by version, as the module docstring keeps them
    young: dict[int, list[int]] = {}
    gone = 0  # the newest version whose document went
    for step in range(120):
        kept = [*old.values(), *young.values()]
        doc = [rng.randrange(vocab) for _ in range(rng.randrange(0, max_tokens // 4))]
        if step % 7 == 0 and kept:  # copy a span of an earlier document: long matches happen
            src = rng.choice(kept)
            doc += src[rng.randrange(len(src)):]
        h.add(doc)
        doc = doc[-max_tokens:]
        if doc:
            if young and sum(map(len, young.values())) + len(doc) > max_tokens // 2:
                gone = max([gone, *old])
                old, young = young, {}
            while old and sum(map(len, [*old.values(), *young.values()])) + len(doc) > max_tokens:
                gone = max(gone, next(iter(old)))
                old.pop(next(iter(old)))
            young[step + 1] = doc  # its version: adds so far, empty ones included
        held = {**old, **young}
        kept = list(held.values())
        assert (h.documents, h.tokens) == (len(kept), sum(map(len, kept)))
        since = rng.randrange(step + 3)  # what a replica that last saw version `since` gets
        want = ([d for v, d in held.items() if v > since], step + 1) if gone <= since <= step + 1 else None
        got = h.documents_since(since, h.epoch)
        assert (got if got is None else ([d.tolist() for d in got[0]], got[1])) == want
        for _ in range(5):
            src = rng.choice(kept) if kept and rng.random() < 0.7 else [rng.randrange(vocab) for _ in range(20)]
            cut = rng.randrange(len(src) + 1)
            context = [rng.randrange(vocab)] * rng.randrange(3) + src[max(0, cut - 15): cut]
            length = rng.randrange(0, 6)
            want = _brute(kept, context, max_ngram, min_ngram, length) if length else None
            assert h.propose(context, length) == want
    back = SuffixHistory.from_bytes(h.to_bytes(), max_tokens, max_ngram, min_ngram)
    assert (back.documents, back.tokens) == (h.documents, h.tokens)
    assert back.documents_since(back.version, back.epoch) == ([], back.version)
    assert back.documents_since(back.version - 1, back.epoch) is None  # a blob keeps no version per document
    assert back.epoch != h.epoch and back.documents_since(back.version, h.epoch) is None  # another history's
    for doc in kept:
        assert back.propose(doc[:-1], 3) == h.propose(doc[:-1], 3)
    assert h.memory_bytes() >= 4 * h.tokens


def test_concurrent_adds_and_proposals():
    h = SuffixHistory(max_tokens=500, min_ngram=2)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(100):
                h.add([rng.randrange(20) for _ in range(rng.randrange(1, 60))])
                p = h.propose([rng.randrange(20) for _ in range(6)], 4)
                assert p is None or 1 <= len(p.tokens) <= 4
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and h.version == 400 and h.tokens <= 500


def test_local_source_keeps_one_history_across_requests():
    from trserve.core.model_spec import ModelSpec
    from trserve.engine.tr.matrix import AdjacencyMatrix
    from trserve.engine.tr.source import LocalDraftSource, MatrixSession
    from trserve.engine.tr.tree import TreeTemplate, compile_tree

    spec, tree = ModelSpec("fp", 50, 2), compile_tree(TreeTemplate.from_paths("ex", [[0], [1], [0, 0]]))
    history = SuffixHistory(min_ngram=2)
    source = LocalDraftSource(AdjacencyMatrix(spec), history)
    first = source.open(tree, spec)
    assert first.history is history
    first.remember([4, 5, 6, 7])
    first.close(None)
    assert source.open(tree, spec).history.propose([5, 6], 3) == Proposal([7], 2)
    bare = MatrixSession(AdjacencyMatrix(spec), tree)
    assert bare.history is None and LocalDraftSource(AdjacencyMatrix(spec)).open(tree, spec).history is None
    bare.remember([1, 2, 3])  # no history: nothing happens


def test_a_proposal_never_waits_on_an_add():
    h = _history([1, 2, 3, 4])
    with h._write:  # an add in progress (e.g. rebuilding the index) holds this
        got = []
        t = threading.Thread(target=lambda: got.append(h.propose([1, 2, 3], 1)))
        t.start()
        t.join(5)
        assert got == [Proposal([4], 3)]
