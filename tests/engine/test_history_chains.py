"""Static trees draft from the tenant's history too (tiny model): where the history matches a longer
suffix than the request's own context, its continuation is grafted as the chain, counted as
"history"; the output stays plain decoding's, and another tenant's requests never draft from it."""

from __future__ import annotations

import pytest
import torch

from trserve.engine import GenerationRequest
from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.drafting.proposers import static_chain
from trserve.engine.drafting.dynamic import CONTEXT, HISTORY
from trserve.engine.tr.history import SuffixHistory
from trserve.engine.tr.lookup import ContextLookup, Proposal
from trserve.engine.drafting.budget.choose import chain_kind
from tests.conftest import tiny_decoder
from tests.engine.test_engine import _prompt, _run, _submit

V = 64


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_decoder(V, seed=3, seed_from_prompt=4, tree="cpu-hybrid")
    torch.set_num_threads(threads)


def _request(mode: str = "tr") -> GenerationRequest:
    return GenerationRequest(input_ids=_prompt(5, 12), max_new_tokens=40, ignore_eos=True, mode=mode)


def test_a_static_tree_grafts_its_tenants_history_and_another_tenant_never_does(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=2, explore_every=10**6), cost=lambda w, kv: 1.0 + 0.01 * w)
    a, b = tiny.new_tenant(), tiny.new_tenant()
    first = _submit(engine, tiny, _request(), matrix=a)
    _run(engine)
    assert a.history.documents == 1 and first[-1].stats.tree == "cpu-hybrid"
    again = _submit(engine, tiny, _request(), matrix=a)  # its history holds the whole answer
    other = _submit(engine, tiny, _request(), matrix=b)  # another tenant's: it knows nothing of it
    plain = _submit(engine, tiny, _request("ar"))
    _run(engine)
    assert again[-1].ids == other[-1].ids == first[-1].ids == plain[-1].ids
    assert again[-1].stats.accepted.get("history", 0) >= 20
    assert "history" not in other[-1].stats.drafted and "history" not in first[-1].stats.drafted
    assert again[-1].stats.mat > other[-1].stats.mat
    # the budget measured the history's chains (matches of 3-4 or 5+ tokens) apart from the context's
    rates = list(engine.budget.rates._rates.values())
    assert sum(r.chain_verified[chain_kind(True, n), 0] for r in rates for n in (3, 5)) >= 1


def test_the_longer_match_wins_and_is_cut_to_the_templates_cap():
    """The chain choice itself: the request's own proposal on a tie or a longer match, else the
    history's, cut to caps[n - 1] for its match size n."""
    caps = (0, 3, 8, 12)  # cpu-hybrid's
    history = SuffixHistory()  # min_ngram 3
    history.add([1, 2, 3, 4, 5] + list(range(20, 40)))
    # the history matches [1..5] (5 tokens: counted as 4, the template's longest), its own context nothing
    longer = ContextLookup([9, 1, 2, 3, 4, 5])
    assert static_chain(longer, history, caps) == (Proposal(list(range(20, 32)), 4), HISTORY)  # cap 12
    assert static_chain(longer, None, caps) == (None, CONTEXT)
    assert static_chain(longer, history, ()) == (None, CONTEXT)  # a template without chains: none
    three = ContextLookup([9, 3, 4, 5])  # a 3-token match: cap 8
    assert static_chain(three, history, caps) == (Proposal(list(range(20, 28)), 3), HISTORY)
    # its own context repeats [4, 5] -> 6, 7: 2 tokens against the history's 3
    own_shorter = ContextLookup([4, 5, 6, 7, 3, 4, 5])
    assert static_chain(own_shorter, history, caps) == (Proposal(list(range(20, 28)), 3), HISTORY)
    # its own context repeats [3, 4, 5] too (a tie at 3 tokens): its own continuation, to its end
    tie = ContextLookup([3, 4, 5, 6, 7, 3, 4, 5])
    assert static_chain(tie, history, caps) == (Proposal([6, 7, 3, 4, 5], 3), CONTEXT)
    assert static_chain(tie, history, (0, 3, 0)) == (None, CONTEXT)  # size 3 capped at 0 (the history's too)
