"""Online tuner state: records and chosen tree round-trip through bytes; TunerBook restores/saves."""

import numpy as np
import pytest
import torch

from trserve.engine.tr.tree import TreeTemplate
from trserve.engine.tuning.calibrate import CostModel
from trserve.engine.tuning.online import AutoTuneConfig, OnlineTuner, TunerBook

UNIVERSE = TreeTemplate.from_paths("u", [[0], [1], [0, 0]])
COST = CostModel("t", (1, 64), (100,), ((1.0, 1.5),))


def _tuner() -> OnlineTuner:
    cfg = AutoTuneConfig(explore_every=2, explore_budget=None, retune_every=4, min_records=4, max_ngram=0)
    return OnlineTuner(cfg, UNIVERSE, TreeTemplate.from_paths("s", [[0]]), COST, torch.device("cpu"), torch.float32)


def _trained() -> OnlineTuner:
    t = _tuner()
    for _ in range(4):
        t.log.record(3, 100)
        t.recorded()
    assert t.retunes == 1 and t.current.paths == ((0,), (0, 0))
    return t


def test_state_round_trips():
    a = _trained()
    b = _tuner()
    b.restore(a.state())
    assert b.current.paths == a.current.paths and b.retunes == 1 and b.log.total_steps == 4
    assert all(np.array_equal(a.log.arrays()[k], b.log.arrays()[k]) for k in a.log.arrays())
    assert b.plan().select.tolist() == [0, 1, 3]  # the restored tree is what gets verified


def test_restore_rejects_garbage_and_other_universes():
    t = _tuner()
    with pytest.raises(ValueError):
        t.restore(b"not a tuner state")
    other = OnlineTuner(AutoTuneConfig(max_ngram=0), TreeTemplate.from_paths("v", [[0], [1]]),
                        TreeTemplate.from_paths("s", [[0]]), COST, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError):
        t.restore(other.state())
    assert t.current.paths == ((0,),) and len(t.log) == 0  # unchanged


class _States:
    def __init__(self, blobs=None, fail=False):
        self.blobs, self.fail = dict(blobs or {}), fail

    def load(self, key):
        if self.fail:
            raise ConnectionError("store down")
        return self.blobs.get(key)

    def save(self, key, blob):
        if self.fail:
            raise ConnectionError("store down")
        self.blobs[key] = blob


def test_book_restores_new_tuners_and_saves_after_retunes():
    states = _States({"acme": _trained().state()})
    book = TunerBook(_tuner, states=states)
    assert book.get("acme").current.paths == ((0,), (0, 0))  # resumed
    fresh = book.get("globex")
    assert fresh.current.paths == ((0,),) and "globex" not in states.blobs
    for _ in range(4):
        fresh.log.record(3, 100)
        fresh.recorded()
    assert "globex" in states.blobs  # saved after its re-tune
    fresh.log.record(3, 100)
    book.save_all()  # e.g. at shutdown: what came after the re-tune is kept too
    assert TunerBook(_tuner, states=states).get("globex").log.total_steps == 5


def test_book_serves_when_the_state_store_is_down():
    book = TunerBook(_tuner, states=_States(fail=True))
    t = book.get("acme")  # starts fresh instead of failing
    for _ in range(4):
        t.log.record(3, 100)
        t.recorded()  # saving fails, tuning and decoding go on
    assert t.retunes == 1
