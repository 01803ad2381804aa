"""Dynamic trees in the engine (tiny model): exact output, plain steps where no node pays, drafts
from a tenant's history, and tenants that never see each other's history."""

from __future__ import annotations

import pytest
import torch

from trserve.engine import GenerationRequest
from trserve.engine.engine import BatchEngine, EngineConfig
from tests.conftest import tiny_decoder
from tests.engine.test_engine import _prompt, _run, _submit

V = 64


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_decoder(V, seed=3, seed_from_prompt=4, tree="dynamic")
    torch.set_num_threads(threads)


def _request(i: int, n: int = 8, new: int = 24, mode: str = "tr") -> GenerationRequest:
    return GenerationRequest(input_ids=_prompt(i, n), max_new_tokens=new, ignore_eos=True, mode=mode)


def test_grown_trees_in_a_batch_decode_as_plain_decoding(tiny):
    flat = BatchEngine(tiny, EngineConfig(max_batch=4), cost=lambda w, kv: 1.0)  # free width: trees always pay
    tenant = tiny.new_tenant()
    trs = [_submit(flat, tiny, _request(i), matrix=tenant) for i in range(6)]
    _run(flat)
    plain = BatchEngine(tiny, EngineConfig(max_batch=4))
    ars = [_submit(plain, tiny, _request(i, mode="ar")) for i in range(6)]
    _run(plain)
    for tr, ar in zip(trs, ars):
        assert tr[-1].ids == ar[-1].ids
    stats = [o[-1].stats for o in trs]
    assert sum(s.mat for s in stats) / len(stats) > 1.2  # the trees were verified and drafts accepted
    assert all(s.tree == "dynamic" for s in stats)
    drafted = sum(s.drafted.get("matrix", 0) for s in stats)
    accepted = sum(s.accepted.get("matrix", 0) for s in stats)
    assert 0 < accepted <= drafted


def test_compute_bound_costs_keep_every_step_plain_and_grow_nothing(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=8, explore_every=10**6), cost=lambda w, kv: float(w))
    outs = [_submit(engine, tiny, _request(i), matrix=tiny.new_tenant()) for i in range(4)]
    _run(engine)
    for o in outs:
        assert o[-1].stats.mat == 1.0 and o[-1].stats.drafted == {}


def test_a_tenant_drafts_from_its_history_and_another_tenant_never_does(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=2), cost=lambda w, kv: 1.0 + 0.01 * w)
    a, b = tiny.new_tenant(), tiny.new_tenant()
    secret = _request(5, n=12, new=32)
    first = _submit(engine, tiny, secret, matrix=a)
    _run(engine)
    again = _submit(engine, tiny, secret, matrix=a)  # the same request again: its history knows the answer
    other = _submit(engine, tiny, secret, matrix=b)  # the same request from another tenant: it knows nothing
    _run(engine)
    assert again[-1].ids == other[-1].ids == first[-1].ids
    assert again[-1].stats.accepted.get("history", 0) > 8
    assert again[-1].stats.mat > other[-1].stats.mat
    assert "history" not in other[-1].stats.drafted
    assert b.history.documents == 1  # its own request only (remembered at its end)
    assert b.matrix is not a.matrix and a.history is not b.history


def test_a_request_whose_trees_miss_their_calibration_is_priced_at_what_it_accepts():
    """The per-request trust (engine/drafting/proposers/grown.py: Trust): a tenant's calibration averages
    its traffic, so a request whose grown trees accept less than calibrated has its trees priced down."""
    from types import SimpleNamespace

    from trserve.engine.drafting.dynamic import Grown
    from trserve.engine.drafting.proposers.grown import TRUST_CAP, TRUST_PRIOR, GrownTrees, Trust

    fresh, missing, beating = Trust(), Trust(12.0, 4.0), Trust(4.0, 40.0)  # missing: 12 tokens expected, 4 accepted
    assert fresh.value() == 1.0
    assert missing.value() == (4 + TRUST_PRIOR) / (12 + TRUST_PRIOR) == 0.5
    assert beating.value() == TRUST_CAP
    grown = Grown(tokens=[1, 2, 3], parent=[0, 0, 1], source=[0, 1, 1], bins=[-1, 0, 0], score=[1.0, 0.8, 0.4])
    fresh_opts = GrownTrees.options(grown, fresh.value())
    missing_opts = GrownTrees.options(grown, missing.value())
    assert [o.gain for o in fresh_opts] == pytest.approx([1.0, 1.8, 2.2])  # plain, 2 nodes, the whole tree
    assert [o.gain for o in missing_opts] == pytest.approx([1.0, 1.4, 1.6])  # drafted tokens at half


def test_a_request_learns_its_trust_from_its_own_verified_trees(tiny):
    engine = BatchEngine(tiny, EngineConfig(max_batch=2), cost=lambda w, kv: 1.0)  # free width: trees always pay
    seen = []
    learn = engine.drafter.learn

    def spy(seq, draft, acc, past):
        learn(seq, draft, acc, past)
        seen.append((seq.drafting.state.predicted, seq.drafting.state.realized))  # the grown proposer's own state

    engine.drafter.learn = spy
    _submit(engine, tiny, _request(1), matrix=tiny.new_tenant())
    _run(engine)
    assert seen and seen[-1][0] > 0 and 0 <= seen[-1][1]
    assert all(b[0] >= a[0] and b[1] >= a[1] for a, b in zip(seen, seen[1:]))  # sums over the request's trees


def test_plain_rows_get_each_rows_own_confidences_from_the_forward(decoder):
    """The plain rows' confidences come from the native forward's pool (probs=True): the same values,
    in the same order, as one C call per row on the step's logits (an AR request's row in the middle
    is skipped)."""
    from trserve.engine.tr.recycle import root_rows

    if decoder.engine.runner.native is None:
        pytest.skip("the forward's confidences are the native forward's")
    engine = BatchEngine(decoder, EngineConfig(max_batch=3, prefix_cache_mb=0), cost=lambda w, kv: float(w))
    outs = [_submit(engine, decoder, GenerationRequest(messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                                       max_new_tokens=16, mode=mode), matrix=decoder.new_tenant())
            for i, mode in enumerate(("tr", "ar", "tr"))]
    _run(engine, until=lambda: len(engine.running) == 3)
    running = engine.running
    with engine.stepping():
        logits = engine.runner.step([engine.drafter._plain_input(live.root) for live in running], probs=True)
        tops = engine.runner.last_topk
        tr = [i for i, live in enumerate(running) if live.drafting.session is not None]  # the rows the engine recycles
        probs = engine.runner.last_probs
        got = root_rows([logits[i] for i in tr], [tops[i] for i in tr], [probs[i] for i in tr],
                        decoder.config.k, engine.top_probs)
        engine.runner.keep([[0]] * 3)
    assert len(tr) == 2 and len(got) == 2
    for i, (ids, probs) in zip(tr, got):
        assert torch.equal(ids, tops[i][0])
        assert torch.equal(probs, engine.top_probs(logits[i][:1], tops[i][:1])[0])
    _run(engine)
    assert all(isinstance(o[-1].ids, list) for o in outs)
