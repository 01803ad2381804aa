"""Calibration and the tree optimiser on tiny, hand-checkable inputs."""

from types import SimpleNamespace

import numpy as np
import torch

from trserve.engine.tr.tree import TreeTemplate, compile_tree
from trserve.engine.tuning.calibrate import CostModel, load_or_measure, measure
from trserve.engine.tuning.optimise import evaluate, tune
from tests.conftest import tiny_llama

UNIVERSE = TreeTemplate.from_paths("u", [[0], [1], [0, 0]])  # nodes: 1=[0], 2=[1], 3=[0,0]
PATHS = compile_tree(UNIVERSE).path_nodes.numpy()


def _records(nodes, ngram=None, plen=None, run=None, graft=None):
    n = len(nodes)
    zero = [0] * n
    cols = dict(node=nodes, kv=[100] * n, ngram=ngram or zero, plen=plen or zero, run=run or zero, graft=graft or zero)
    return {k: np.array(v, dtype=np.int64) for k, v in cols.items()}


def _cost(per_token: float) -> CostModel:
    """1 s per forward plus `per_token` s per node."""
    widths = (1, 64)
    return CostModel("t", widths, (100,), (tuple(1.0 + per_token * w for w in widths),))


REC = _records([3] * 6 + [2] * 2 + [0] * 2)  # accepted depth 2 (60%), 1 via [1] (20%), 0 (20%)


def test_flat_cost_takes_the_whole_tree():
    r = tune(REC, UNIVERSE, PATHS, _cost(0.0))
    assert r.template.size == 3 and abs(r.mat - 2.4) < 1e-9


def test_expensive_width_takes_a_small_tree():
    # 2 s per node: size 1 -> 1.6 tok / 5 s beats size 2 -> 2.2 / 7 s and size 3 -> 2.4 / 9 s
    r = tune(REC, UNIVERSE, PATHS, _cost(2.0))
    assert r.template.paths == ((0,),) and abs(r.mat - 1.6) < 1e-9
    assert [t.size for t, _, _ in r.by_size] == [1, 2, 3]
    assert [round(t, 4) for _, t, _ in r.by_size] == [round(1.6 / 5, 4), round(2.2 / 7, 4), round(2.4 / 9, 4)]


def test_chain_caps_follow_what_lookup_delivers():
    # bigram matches confirm 6 of 8 proposed tokens; unigram matches confirm nothing
    rec = _records([0] * 8, ngram=[2] * 4 + [1] * 4, plen=[8] * 8, run=[6] * 4 + [0] * 4)
    r = tune(rec, UNIVERSE, PATHS, _cost(0.05), max_ngram=2)
    assert r.template.lookup[0] == 0 and 6 <= r.template.lookup[1] <= 8
    member = np.array([True, True, False, False])
    tps, mat = evaluate(rec, PATHS, member, (0, 6), _cost(0.05))
    assert abs(mat - (4 * 7 + 4 * 1) / 8) < 1e-9


def test_chain_overlap_with_the_tree_costs_nothing():
    # the proposal's first token is node [0] itself (graft at node 1): a chain of 1 adds no width
    rec = _records([1] * 4, ngram=[1] * 4, plen=[1] * 4, run=[1] * 4, graft=[1] * 4)
    member = np.array([True, True, False, False])
    tps, mat = evaluate(rec, PATHS, member, (1,), _cost(1.0))
    assert mat == 2 and abs(tps - 2 / 3) < 1e-9


def test_measure_and_cache(tmp_path):
    model = tiny_llama()
    cm = measure(model, widths=(1, 4, 8), kv_lens=(8, 16), reps=1, key="k")
    assert len(cm.seconds) == 2 and all(len(r) == 3 for r in cm.seconds)
    assert all(list(r) == sorted(r) for r in cm.seconds)  # a wider forward never costs less
    loaded = SimpleNamespace(model=model, fingerprint="fp", device=torch.device("cpu"), kernels="stock")
    first = load_or_measure(loaded, tmp_path, reps=1)
    assert list(tmp_path.glob("calibration/*.json"))
    assert load_or_measure(loaded, tmp_path) == first  # read back, not measured again


def test_cost_model_interpolates():
    cm = CostModel("k", (1, 8, 16), (100, 1000), ((1, 2, 3), (2, 4, 6)))
    assert cm.cost(8, 550) == 3.0 and cm.cost(200, 5000) == 6.0
    assert np.allclose(cm.costs(np.array([1, 4]), np.array([100, 550])), [1.0, 15 / 7])


def test_online_tuner_explores_then_retunes():
    from trserve.engine.tuning.online import AutoTuneConfig, OnlineTuner

    universe = TreeTemplate.from_paths("u", [[0], [1], [0, 0]])
    tuner = OnlineTuner(AutoTuneConfig(explore_every=2, explore_budget=None, retune_every=4, min_records=4, max_ngram=0),
                        universe, TreeTemplate.from_paths("s", [[0]]), _cost(0.0), torch.device("cpu"), torch.float32)
    plans = [tuner.plan() for _ in range(4)]
    assert [p.explore for p in plans] == [False, True, False, True]
    assert plans[0].select.tolist() == [0, 1] and plans[1].tree is tuner.universe
    for _ in range(4):  # depth-2 acceptances through [0, 0]; [1] never helps, so it is left out
        tuner.log.record(3, 100)
        tuner.recorded()
    assert tuner.retunes == 1 and tuner.current.paths == ((0,), (0, 0))
    assert tuner.plan().select.tolist() == [0, 1, 3]


def test_exploration_stays_within_its_share_of_verification_time():
    from trserve.engine.tuning.online import AutoTuneConfig, OnlineTuner

    # a forward of w tokens costs w ms: universe 4 nodes + 16 chain = 20 ms, current 2 nodes = 2 ms
    cost = CostModel("k", (1, 128), (100, 1000), ((0.001, 0.128), (0.001, 0.128)))
    universe = TreeTemplate.from_paths("u", [[0], [1], [0, 0]])
    tuner = OnlineTuner(AutoTuneConfig(explore_every=4, explore_budget=0.25, max_chain=16), universe,
                        TreeTemplate.from_paths("s", [[0]]), cost, torch.device("cpu"), torch.float32)
    assert tuner.explore_every == 40  # 20 ms / (0.25 * 2 ms)
    assert [tuner.plan().explore for _ in range(80)].count(True) == 2
    loose = OnlineTuner(AutoTuneConfig(explore_every=4, explore_budget=1.0, max_chain=16), universe,
                        TreeTemplate.from_paths("s", [[0]]), cost, torch.device("cpu"), torch.float32)
    assert loose.explore_every == 10


def test_adaptive_decoder_is_lossless_and_retunes(loaded_smollm2, decoder, tmp_path):
    from trserve.engine import Decoder, DecoderConfig
    from trserve.engine.tuning.calibrate import CostModel, cost_model_path, save_cost_model
    from trserve.engine.tuning.online import AutoTuneConfig

    widths = (1, 128)  # a made-up, cheap-to-write cost curve: the test checks mechanics, not speed
    save_cost_model(CostModel("t", widths, (128,), ((0.04, 0.30),)), cost_model_path(loaded_smollm2, tmp_path))
    config = DecoderConfig(tree="adaptive", cache_dir=str(tmp_path),
                           autotune=AutoTuneConfig(explore_every=2, explore_budget=None, retune_every=6, min_records=6))
    adaptive = Decoder(config, loaded=loaded_smollm2)
    msgs = [{"role": "user", "content": "List the planets of the solar system in order, one per line."}]
    r = adaptive.generate(messages=msgs, max_new_tokens=48)
    assert r.ids == decoder.generate(messages=msgs, max_new_tokens=48, mode="ar").ids
    assert adaptive.autotuner.retunes >= 1 and r.stats.tree.startswith("adaptive:")


def test_finalists_one_per_size_band():
    from trserve.engine.tuning.optimise import TuneResult

    rows = [(TreeTemplate.from_paths("t", [[r] for r in range(n)]), float(tps), 1.0)
            for n, tps in [(1, 5), (2, 9), (5, 8), (6, 7), (12, 1)]]
    result = TuneResult(rows[1][0], 9.0, 1.0, by_size=rows)
    assert [t.size for t in result.finalists()] == [2, 5, 12]
