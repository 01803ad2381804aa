"""Prompt lookup, grafting lookup chains into the static tree, and acceptance through a chain."""

import numpy as np
import pytest
import torch

from trserve.core.errors import InvalidArgument
from trserve.engine.tr.accept import accept_greedy
from trserve.engine.drafting.hybrid import attach_chain, graft, graft_point, matched_run
from trserve.engine.tr.lookup import ContextLookup, find_continuation
from trserve.engine.tr.tree import TreeTemplate, compile_tree, load_template
from trserve.engine.tuning.records import AcceptanceLog

TREE = compile_tree(TreeTemplate.from_paths("ex", [[0], [1], [0, 0]]))


def test_find_continuation_worked_example():
    p = find_continuation(np.array([1, 2, 3, 9, 1, 2]), max_ngram=2, min_ngram=1, length=3)
    assert p.tokens == [3, 9, 1] and p.ngram == 2


def test_find_continuation_prefers_longest_match_then_most_recent():
    ctx = np.array([7, 5, 1, 4, 5, 2, 8, 5])
    # suffix [5]: occurrences at 1 and 4; the most recent (4) continues with [2, 8]
    assert find_continuation(ctx, 2, 1, 2).tokens == [2, 8]
    assert find_continuation(ctx, 2, 2, 2) is None  # [8, 5] never occurred before
    ctx = np.array([8, 5, 9, 3, 5, 1, 8, 5])  # [8, 5] at 0 beats the more recent unigram match [5] at 4
    assert find_continuation(ctx, 2, 1, 2) .tokens == [9, 3]


def test_context_lookup_grows_and_applies_caps():
    lk = ContextLookup([1, 2, 3])
    lk.extend([4, 1, 2])
    assert lk.propose((4, 4)).tokens == [3, 4, 1, 2]
    assert lk.propose((4, 2)).tokens == [3, 4]  # bigram match [1, 2]: capped at 2
    assert lk.propose((4, 0)) is None  # bigram matches are ignored, unigrams are not tried
    assert lk.propose((0, 0)) is None and lk.propose(()) is None


def test_graft_point_worked_example():
    children = ((1, 2), (3,), (), ())
    assert graft_point([5, 7, 9, 3], children, [7, 3, 4]) == (3, 2)
    assert graft_point([5, 7, 9, 3], children, [8, 1]) == (0, 0)


def test_attach_chain_structure():
    t = attach_chain(TREE, 1, 2)  # chain of 2 below node 1 (path [0])
    assert t.n == 6
    assert t.parent.tolist() == [0, 0, 0, 1, 1, 4]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.path_to(5) == [0, 1, 4, 5]
    assert t.children == ((1, 2), (3, 4), (), (), (5,), ())
    visible = (t.mask == 0).int().tolist()
    assert visible[5] == [1, 1, 0, 0, 1, 1] and visible[4] == [1, 1, 0, 0, 1, 0] and visible[3] == [1, 1, 0, 1, 0, 0]
    assert attach_chain(TREE, 1, 2) is t  # compiled once


def test_graft_then_accept_through_the_chain():
    drafted = torch.tensor([5, 7, 9, 3])
    tokens, tree, info = graft(drafted, TREE, [7, 4, 6], ngram=2)
    assert tokens.tolist() == [5, 7, 9, 3, 4, 6] and info.at == 1 and info.chain == 2
    greedy = torch.zeros(6, dtype=torch.long)
    greedy[[0, 1, 4, 5]] = torch.tensor([7, 4, 6, 2])  # the model continues 7 4 6 then 2
    acc = accept_greedy(tokens, greedy, tree)
    assert acc.path == [0, 1, 4, 5] and acc.tokens == [7, 4, 6, 2]
    assert matched_run(info.proposal, acc.tokens) == 3


def test_graft_inside_the_tree_adds_nothing():
    tokens, tree, info = graft(torch.tensor([5, 7, 9, 3]), TREE, [7, 3], ngram=1)
    assert tree is TREE and tokens.tolist() == [5, 7, 9, 3] and info.chain == 0 and info.at == 3


def test_lookup_in_templates_is_validated_and_round_trips(tmp_path):
    t = TreeTemplate.from_paths("h", [[0], [1]], lookup=[0, 4, 8])
    assert t.max_width == 3 + 8
    path = tmp_path / "h.json"
    path.write_text(t.to_json())
    assert load_template(str(path)) == t
    with pytest.raises(InvalidArgument, match="lookup"):
        TreeTemplate.from_paths("h", [[0]], lookup=[99])
    with pytest.raises(InvalidArgument, match="lookup"):
        TreeTemplate.from_paths("h", [[0]], lookup=[True])


def test_acceptance_log_window_and_arrays():
    log = AcceptanceLog(TREE.template, max_steps=2)
    for node in (1, 3, 2):
        log.record(node, kv=10)
    cols = log.arrays()
    assert cols["node"].tolist() == [3, 2] and log.total_steps == 3 and len(log) == 2


def test_decoder_hybrid_is_lossless_and_uses_the_chain(decoder):
    base = load_template("cpu-8")
    hybrid = decoder.compile(TreeTemplate.from_paths("cpu-8-lookup", base.paths, lookup=[0, 8, 8]))
    log = AcceptanceLog(hybrid.template)
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat."
    msgs = [{"role": "user", "content": f"Repeat this sentence exactly three times: {text}"}]
    plain = decoder.generate(messages=msgs, max_new_tokens=64, mode="ar")
    r = decoder.generate(messages=msgs, max_new_tokens=64, tree=hybrid, acceptance=log)
    assert r.ids == plain.ids
    cols = log.arrays()
    assert (cols["ngram"] > 0).any() and cols["run"].max() >= 4  # copied spans came from the chain
    assert len(log) == r.stats.steps


def test_context_lookup_index_matches_the_scan():
    """The incremental n-gram index gives find_continuation's answer over the whole context, as the
    context grows a few tokens at a time (small vocabularies: many repeats and ties)."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        vocab = int(rng.integers(2, 9))
        caps = tuple(int(c) for c in rng.integers(0, 6, size=int(rng.integers(1, 6))))
        prompt = rng.integers(0, vocab, size=int(rng.integers(0, 12))).tolist()
        lk = ContextLookup(prompt, max_ngram=int(rng.integers(0, 4)))
        ctx = list(prompt)
        for _ in range(12):
            usable = [n for n, c in enumerate(caps, start=1) if c > 0]
            want = None
            if usable and len(ctx) >= 2:
                found = find_continuation(np.array(ctx, dtype=np.int64), len(caps), usable[0], max(caps))
                if found is not None and caps[found.ngram - 1]:
                    want = (found.tokens[: caps[found.ngram - 1]], found.ngram)
            got = lk.propose(caps)
            assert (got.tokens, got.ngram) == want if got is not None else want is None, (trial, ctx, caps)
            new = rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
            lk.extend(new)
            ctx += new
        assert len(lk) == len(ctx)
