"""Lossless sampling: processing vs transformers, the point-mass rule, seeds, and a statistical
test of TR-sampled sequences against exact enumeration on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from trserve.engine import InvalidArgument, SamplingParams
from trserve.engine.tr.accept import accept_greedy
from trserve.engine.tr.sampling import Sampler, choose, choose_in_tree, inverse_cdf, processed_probs
from trserve.engine.tr.tree import TreeTemplate, compile_tree
from tests.conftest import tiny_decoder

V = 16  # tiny vocabulary: exact distributions of 3 tokens are V**3 = 4096 cells
PROMPT = [3, 7, 1, 12]


# ---- pure functions ------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": "hot"},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_p": math.nan},
    {"min_p": -0.1}, {"min_p": 1.5}, {"min_p": math.nan}, {"min_p": True}, {"min_p": "0.1"},
    {"seed": -1}, {"seed": 2**64}, {"seed": 1.0},
])
def test_invalid_params_are_refused(kwargs):
    with pytest.raises(InvalidArgument):
        SamplingParams(**kwargs)


def test_defaults_are_greedy_and_off():
    p = SamplingParams()
    assert p.greedy and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 and p.seed is None
    assert not SamplingParams(temperature=0.7, seed=2**64 - 1).greedy


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (0.7, 0, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.5, 10, 0.9, 0.0), (1.0, 100, 0.3, 0.0),
    (2.0, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 0, 1.0, 0.02), (0.7, 10, 0.9, 0.05), (2.0, 20, 0.95, 0.2),
    (1.3, 0, 0.8, 0.3), (1.0, 0, 1.0, 1.0),
])
def test_processing_matches_transformers_warpers(temperature, top_k, top_p, min_p):
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3  # [6, 50]
    logits[0, :4] = 5.0  # a tie at the top-k threshold: transformers keeps all tied tokens
    logits[1, :3] = logits[1].max() + 1  # a tie at the top: min_p=1 keeps all three
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    scores = MinPLogitsWarper(min_p)(None, scores)  # generate adds it whenever min_p is set, 0 included
    theirs = scores.softmax(dim=-1)  # [6, 50]
    ours = processed_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p))
    assert torch.equal(ours > 0, theirs > 0)  # the same kept set
    torch.testing.assert_close(ours, theirs)
    if min_p == 1.0:
        assert (ours > 0).sum(dim=-1).tolist() == [1, 3, 1, 1, 1, 1]


def test_processing_worked_example():
    probs = processed_probs(torch.tensor([[2.0, 1.0, 0.0, -9.0]]), SamplingParams(1.0, top_k=3, top_p=0.9))
    torch.testing.assert_close(probs, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4, rtol=0)
    probs = processed_probs(torch.tensor([[2.0, 1.0, 0.0, -9.0]]), SamplingParams(1.0, min_p=0.3))
    torch.testing.assert_close(probs, torch.tensor([[0.7311, 0.2689, 0.0, 0.0]]), atol=1e-4, rtol=0)
    probs = processed_probs(torch.tensor([[2.0, 1.0, 0.0, -9.0]]), SamplingParams(1.0, min_p=0.1))  # bar .067
    torch.testing.assert_close(probs, torch.tensor([[0.6652, 0.2447, 0.0900, 0.0]]), atol=1e-4, rtol=0)


def test_inverse_cdf_never_picks_removed_tokens():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]]).repeat(5, 1)  # [5, 5]
    u = torch.tensor([0.0, 0.1999, 0.2, 0.6, 1 - 1e-16], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [0, 0, 2, 2, 3]


def specinfer_point_mass(p: torch.Tensor, children: list[int]) -> torch.Tensor:
    """Law of the emitted token under SpecInfer's multi-round rule with point-mass drafts."""
    out, residual, reach = torch.zeros_like(p), p.clone(), 1.0
    for c in children:
        accept = float(residual[c] / residual.sum())  # min(1, p'(c) / q(c)) with q = delta(c)
        out[c] += reach * accept
        reach *= 1 - accept
        residual[c] = 0.0  # norm(max(0, p' - delta(c))) = p' with c removed
    return out + reach * residual / residual.sum() if reach > 0 else out  # all tokens drafted: no bonus left


@pytest.mark.parametrize("children", [[3], [3, 0, 5], [5, 3, 1, 0, 2, 4], [0, 0, 0, 2]])
def test_multi_round_rule_with_point_masses_is_exactly_p(children):
    """The docstring's derivation, numerically: ending at c_i has prob p(c_i), the bonus x has p(x);
    a duplicate child is tried again with acceptance 0 (its residual mass is gone)."""
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1], dtype=torch.float64)
    torch.testing.assert_close(specinfer_point_mass(p, children), p)


def test_samples_feed_greedy_acceptance_by_position():
    """One uniform per output position: equal logits at the same depth sample the same token."""
    tree = compile_tree(TreeTemplate.from_paths("t", [[0], [1], [0, 0]]))  # depth [0, 1, 1, 2]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11), positions=8)
    logits = torch.randn(1, 10).repeat(4, 1)  # [4, 10] the same next-token law everywhere
    choices = choose(logits, sampler, 5 + tree.depth)  # [4]
    assert choices[1] == choices[2]  # siblings share position 6
    assert choices.tolist() == [int(choose(logits[:1], sampler, 5 + int(d))[0]) for d in tree.depth]
    tokens = torch.tensor([9, int(choices[0]), int(choices[0]) ^ 1, int(choices[1])])
    acc = accept_greedy(tokens, choices, tree)
    assert acc.path == [0, 1, 3] and acc.tokens == [int(choices[0]), int(choices[1]), int(choices[3])]
    assert torch.equal(choose(logits, None, 5 + tree.depth), logits.argmax(dim=-1))


def test_sampling_only_reachable_nodes_accepts_the_same():
    """choose_in_tree samples a few nodes; acceptance equals sampling every node (duplicates included)."""
    tree = compile_tree(TreeTemplate.from_paths("t", [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]]))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tree.n, 6, generator=gen) * 2  # [n, 6]
    sampled = 0
    for seed in range(100):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), positions=16)
        full = choose(logits, sampler, 3 + tree.depth)  # [n] every node
        hit = torch.rand(tree.n, generator=gen) < 0.6
        tokens = torch.where(hit, full[tree.parent], torch.randint(0, 6, (tree.n,), generator=gen))  # [n]
        lazy = choose_in_tree(logits, tokens, tree, sampler, 3)
        assert accept_greedy(tokens, lazy, tree) == accept_greedy(tokens, full, tree)
        assert torch.equal(lazy[lazy >= 0], full[lazy >= 0])
        sampled += int((lazy >= 0).sum())
    assert sampled < 100 * tree.n * 0.7  # it really skipped nodes
    assert torch.equal(choose_in_tree(logits, tokens, tree, None, 3), logits.argmax(dim=-1))


def test_uniforms_depend_on_seed_and_position_only():
    a = Sampler(SamplingParams(temperature=0.5, seed=7), positions=5).uniforms
    b = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=7), positions=12).uniforms
    assert torch.equal(a, b[:5]) and not torch.equal(a, Sampler(SamplingParams(0.5, seed=8), 5).uniforms)
    fresh = [Sampler(SamplingParams(temperature=0.5), 1).seed for _ in range(3)]
    assert len(set(fresh)) == 3  # no seed: a new random one per request


# ---- a tiny model where exact distributions are computable ------------------------------
@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small only lose to thread hand-offs (5-10x slower with 2)
    yield tiny_decoder(V, seed=0, seed_from_prompt=4)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("params", [
    dict(temperature=1.5, top_k=0, top_p=0.8, min_p=0.1), dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.3),
    dict(temperature=2.0, top_k=10, top_p=0.8, min_p=0.3), dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2),
    dict(temperature=0.8, top_k=8, top_p=0.95, min_p=0.2),
])
def test_processing_is_what_generate_samples(tiny, params):
    """The law `model.generate(do_sample=True, temperature, top_k, top_p, min_p)` samples (its processed
    scores): transformers' own order of the warpers, not only each warper alike. Each case is one
    where min_p removes tokens, or where min_p before top_p would keep another set, so a filter
    skipped or applied in the other order fails it."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

    ids = torch.tensor([PROMPT])  # [1, 4]
    with torch.no_grad():
        logits = tiny.model(input_ids=ids).logits[:, -1]  # [1, V]
        out = tiny.model.generate(ids, do_sample=True, max_new_tokens=1, output_scores=True,
                                  return_dict_in_generate=True, pad_token_id=0, **params)
    theirs = out.scores[0].softmax(dim=-1)  # [1, V]
    ours = processed_probs(logits, SamplingParams(**params))
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs)
    off = processed_probs(logits, SamplingParams(**dict(params, min_p=0.0)))  # [1, V]
    before = processed_probs(logits, SamplingParams(**dict(params, top_p=1.0, min_p=0.0))).log()  # [1, V]
    swapped = TopPLogitsWarper(params["top_p"])(None, MinPLogitsWarper(params["min_p"])(None, before))
    assert not torch.equal(ours > 0, off > 0) or not torch.equal(ours > 0, swapped.softmax(dim=-1) > 0)


def exact_first_tokens(model, params: SamplingParams) -> torch.Tensor:
    """p(x1, x2, x3 | PROMPT) under `params`, by enumeration: [V, V, V] float64."""
    pairs = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V*V, 2]
    ids = torch.cat([torch.tensor(PROMPT).repeat(V * V, 1), pairs], dim=1)  # [V*V, len + 2]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -3:]  # [V*V, 3, V]
    probs = processed_probs(logits.reshape(-1, V), params).double().reshape(V, V, 3, V)
    p1 = probs[0, 0, 0]  # [V]
    p2 = probs[:, 0, 1]  # [V, V]: row x1 (the x2 column of `pairs` does not matter here)
    p3 = probs[:, :, 2]  # [V, V, V]
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of multinomial counts against exact cell probabilities (flattened).

    Cells expecting < 5 are pooled into one, so the chi-square approximation holds; the p-value
    is the regularised upper incomplete gamma Q(df/2, stat/2) (no scipy needed).
    """
    n = float(counts.sum())
    counts, probs = counts.flatten().double(), probs.flatten()
    big = probs * n >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])  # [cells]
    exp = torch.cat([probs[big], probs[~big].sum()[None]]) * n
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = int(big.sum())  # cells - 1
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(half[0], half[1]))


ALPHA = 1e-3  # false-alarm rate of the statistical test: a correct sampler fails 1 seed set in 1000
PARAMS = dict(temperature=0.8, top_k=8, top_p=0.95)
MIN_P = dict(temperature=1.0, top_p=0.95, min_p=0.1)
N = 2500  # generations (seeds 0..N-1); deterministic, so the test is not flaky
# nearby wrong laws each sample set must be told from
WRONG = {"top_p": [dict(PARAMS, temperature=1.0), dict(PARAMS, top_p=1.0), dict(PARAMS, top_k=4)],
         "min_p": [dict(MIN_P, min_p=0.0), dict(MIN_P, min_p=0.05), dict(MIN_P, min_p=0.15)]}


@pytest.mark.parametrize("PARAMS, wrongs", [(PARAMS, WRONG["top_p"]), (MIN_P, WRONG["min_p"])], ids=["top_p", "min_p"])
def test_tr_sampled_sequences_follow_the_exact_distribution(tiny, PARAMS, wrongs):
    """Empirical law of (x1, x2, x3) from TR over N seeds vs enumeration; and the test has power."""
    matrix, counts = tiny.new_matrix(), torch.zeros(V, V, V)
    steps = drafted = 0
    for seed in range(N):  # one hot matrix, as a served tenant: drafts must not change the law
        r = tiny.generate(input_ids=PROMPT, max_new_tokens=3, ignore_eos=True, matrix=matrix,
                          sampling=SamplingParams(**PARAMS, seed=seed))
        counts[tuple(r.ids)] += 1
        steps, drafted = steps + r.stats.steps, drafted + sum(r.stats.accepted_per_step) - r.stats.steps
    exact = exact_first_tokens(tiny.model, SamplingParams(**PARAMS))
    assert exact[counts > 0].min() > 0  # never a token that top-k / top-p / min-p removed
    assert drafted / steps > 0.5, "drafts were rarely accepted: the test would not exercise acceptance"
    assert chi_square_pvalue(counts, exact) > ALPHA
    # negative controls: the same samples against nearby wrong laws are rejected
    for wrong in wrongs:
        assert chi_square_pvalue(counts, exact_first_tokens(tiny.model, SamplingParams(**wrong))) < ALPHA, wrong


@pytest.mark.parametrize("more", [{}, {"min_p": 0.1}, {"top_k": 8, "top_p": 0.9, "min_p": 0.05}])
def test_tr_sampling_equals_ar_sampling_with_the_same_seed(tiny, more):
    matrix, steps, tokens = tiny.new_matrix(), 0, 0
    for seed in range(60):
        params = SamplingParams(temperature=1.0, seed=seed, **more)
        tr = tiny.generate(input_ids=PROMPT, max_new_tokens=12, ignore_eos=True, sampling=params, matrix=matrix)
        ar = tiny.generate(input_ids=PROMPT, max_new_tokens=12, ignore_eos=True, sampling=params, mode="ar")
        assert tr.ids == ar.ids, seed
        steps, tokens = steps + tr.stats.steps, tokens + len(tr.ids) - 1
    assert tokens / steps > 1.5  # speculation really happened


def test_same_seed_same_output_in_process(tiny):
    params = SamplingParams(temperature=1.2, top_p=0.9, seed=2024)
    runs = [tiny.generate(input_ids=PROMPT, max_new_tokens=20, ignore_eos=True, sampling=params,
                          matrix=tiny.new_matrix() if i else None, tree=tree)
            for i, tree in enumerate(["cpu-4", "cpu-8", "paper"])]
    assert runs[0].ids == runs[1].ids == runs[2].ids  # whatever the tree or matrix state
    shorter = tiny.generate(input_ids=PROMPT, max_new_tokens=7, ignore_eos=True, sampling=params)
    assert shorter.ids == runs[0].ids[:7]
    others = {tuple(tiny.generate(input_ids=PROMPT, max_new_tokens=20, ignore_eos=True,
                                  sampling=SamplingParams(temperature=1.2, top_p=0.9, seed=s)).ids) for s in range(5)}
    assert len(others) > 1


def test_temperature_zero_is_the_greedy_path(tiny):
    plain = tiny.generate(input_ids=PROMPT, max_new_tokens=16, ignore_eos=True)
    for params in (SamplingParams(), SamplingParams(temperature=0.0, top_k=2, top_p=0.5, seed=9)):
        r = tiny.generate(input_ids=PROMPT, max_new_tokens=16, ignore_eos=True, sampling=params)
        assert r.ids == plain.ids


def test_decoder_refuses_a_bad_sampling_argument(tiny):
    with pytest.raises(InvalidArgument, match="SamplingParams"):
        tiny.generate(input_ids=PROMPT, max_new_tokens=2, sampling={"temperature": 1.0})
