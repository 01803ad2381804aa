"""Lossless sampling with tree drafts: temperature, top-k, top-p, min-p and per-request seeds.

The rule (what is exact, and why)
---------------------------------
Speculative sampling accepts a drafted token x ~ q with probability min(1, p(x)/q(x)) and, on
rejection, samples the residual norm(max(0, p - q)); the committed token is then distributed as
p (Leviathan et al., 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et
al., 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"). For a tree,
SpecInfer (Miao et al., 2024, "SpecInfer: Accelerating LLM Serving with Tree-based Speculative
Inference and Verification", multi-step speculative sampling) tries the children of a node one
after another against the running residual.

Token Recycling's drafts are deterministic, so every child is a point mass q = delta(c). At a
node u with children c1..cm (distinct tokens, rank order) and target p = p(.|u), let
R_j = 1 - p(c1) - ... - p(cj) (R_0 = 1). Round j accepts cj with prob min(1, p_j(cj)/1) where
p_j = p with c1..c_{j-1} zeroed and renormalised, i.e. p(cj)/R_{j-1}; the residual after
rejecting it is p with c1..cj zeroed. Ending at ci has probability
prod_{j<i} (R_j/R_{j-1}) * p(ci)/R_{i-1} = p(ci) (the product telescopes to R_{i-1}), and full
rejection (prob R_m) followed by the bonus x ~ p restricted to non-children emits a non-child x
with prob R_m * p(x)/R_m = p(x): exactly p. The same law is obtained by drawing ONE token
x ~ p(.|u) and moving to the child whose token is x (if any), else emitting x as the bonus.
So a verified tree needs one sample per node, and the existing greedy acceptance
(`trserve.engine.tr.accept.accept_greedy`) runs unchanged with those samples in place of the argmax: node i
matches when tokens[i] == choice[parent[i]]. Across depths this composes: the sample at the
depth-d node on the accepted path is drawn from p(.|its context), which is the committed prefix,
and fresh randomness at each depth makes the committed sequence a chain of exact conditional
draws, i.e. plain ancestral sampling.

Common random numbers per position (how the samples are drawn)
--------------------------------------------------------------
Each node's sample is an inverse-CDF draw with the uniform U[t] of the output position t it
predicts (t = tokens committed before this step + the node's depth). The uniforms come from the
request's seed, one per output position, independent of the draft. Then the token committed at
position t is always F^-1(U[t] | committed prefix): the accepted path only exists where the
drafts equal these tokens, and its bonus is the same draw. So TR commits exactly the sequence
plain autoregressive sampling (`mode="ar"`) commits with the same seed, whatever the matrix,
tree or acceptance order -- the sampling analogue of greedy TR == greedy AR (up to the same
float near-ties: a uniform within ~1e-6 of a CDF boundary may flip with the logits' rounding).
Because U[t] are i.i.d. uniform and each is used once along the committed sequence, that sequence
is distributed exactly as plain sampling from the processed distribution.

Only the nodes acceptance can reach need their sample (`choose_in_tree`): the root, then the
children equal to their parent's sample, level by level -- a few vocabulary rows per step
instead of one per tree node.

This also settles duplicate drafts, which cold (all-zero) matrix rows make common (token 0
drafted several times under one node): with independent samples per node, taking the deepest of
two equal-token branches would favour whichever branch's sample happened to match its drafts --
a bias. With one uniform per position, equal-context siblings draw the same token, so every fully
matched path carries the same committed tokens and the choice among them cannot bias anything.

Processing follows transformers' sampling order (`GenerationMixin._get_logits_processor`) --
temperature, then top-k, then top-p, then min-p -- so the target is the distribution
`generate(do_sample=True, temperature=T, top_k=K, top_p=P, min_p=M)` samples. Every filter only
removes tokens, so the processed law is still one fixed function of the logits at a position, and
all of the above holds for it unchanged. temperature == 0 is greedy: no Sampler is made and the
decoder keeps its exact argmax.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from ...core.errors import InvalidArgument, OutputStuck

MAX_SEED = 2**64 - 1
# Sampling temperatures outside [MIN, MAX] are refused: below ~1e-37 logits / T overflow float32
# (NaN probabilities); well before that sampling is greedy in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 1e4


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Defaults are greedy; the engine's "off" values differ from the API's 0."""

    temperature: float = 0.0  # 0 = greedy (argmax, the other fields are ignored); else sample, in [0.01, 1e4]
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th kept, as transformers); 0 = off
    top_p: float = 1.0  # nucleus: smallest set of top tokens with mass >= top_p, in (0, 1]; 1 = off
    min_p: float = 0.0  # keep tokens with prob >= min_p * the top token's (after top_p), in [0, 1]; 0 = off
    seed: int | None = None  # in [0, 2**64); None = a fresh random seed per request

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature!r}")
        if t != 0 and not MIN_TEMPERATURE * (1 - 1e-6) <= t <= MAX_TEMPERATURE:  # 0.01 as float32 is 0.0099999998
            raise InvalidArgument(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], "
                                  f"got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 and an integer (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgument(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token probabilities after temperature, top-k, top-p, min-p (transformers' order and tie rules).

    logits: [n, V] (any float dtype) -> probs: [n, V] float32, rows sum to 1, removed tokens 0.
    Example: logits [[2, 1, 0, -9]], T=1, top_k=3, top_p=0.9: softmax of the top 3 is
    [.665, .245, .090]; the smallest top set with mass >= .9 is {0, 1} (.91) -> [[.731, .269, 0, 0]].
    Example (min-p): logits [[2, 1, 0, -9]], T=1, min_p=0.3: softmax [.665, .245, .090, 1e-5]; the
    bar is .3 * .665 = .200, so tokens 0 and 1 stay -> [[.731, .269, 0, 0]].
    """
    scores = logits.float() / params.temperature  # [n, V]
    if params.top_k:
        kth = scores.topk(min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]  # [n, 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        ascending, order = scores.sort(dim=-1)  # [n, V]
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - params.top_p  # mass below the nucleus
        drop[..., -1] = False  # always keep the most likely token
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    if params.min_p > 0:  # on the probabilities top-k / top-p left, as transformers' MinPLogitsWarper
        probs = scores.softmax(dim=-1)  # [n, V]
        scores = scores.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    return scores.softmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at which each row's CDF first exceeds u (times the row's total, for rounding).

    probs: [n, V], u: [n] in [0, 1) -> [n] int64. Zero-probability tokens are never chosen.
    Example: probs [[.2, 0, .5, .3]], u [.6] -> CDF [.2, .2, .7, 1.0] -> token 2.
    """
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    target = (u.to(cdf) * cdf[:, -1])[:, None]  # [n, 1]
    token = torch.searchsorted(cdf, target, right=True)[:, 0]  # [n]
    return torch.minimum(token, cdf.argmax(dim=-1))  # u*total rounding up to total: the last token with mass


class Sampler:
    """One request's sampling state: its params and one uniform per output position (from the seed)."""

    def __init__(self, params: SamplingParams, positions: int, device: torch.device | str = "cpu") -> None:
        if params.greedy:
            raise ValueError("a Sampler is for temperature > 0; greedy decoding uses the argmax (no Sampler)")
        self.params = params
        self.seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(64)
        rng = random.Random(self.seed)  # Mersenne Twister: the same stream on every platform and version
        self.uniforms = torch.tensor([rng.random() for _ in range(max(positions, 1))],
                                     dtype=torch.float64, device=device)  # [positions]

    def sample(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """logits: [n, V], positions: [n] output positions predicted -> [n] sampled tokens.

        Positions past the end (drafts deeper than max_new_tokens) reuse the last uniform: their
        tokens are never committed.
        """
        u = self.uniforms[positions.clamp(max=self.uniforms.shape[0] - 1)]  # [n]
        return inverse_cdf(processed_probs(logits, self.params), u)


def new_sampler(params: SamplingParams | None, positions: int, device: torch.device) -> Sampler | None:
    """The request's Sampler, or None for greedy decoding (params None or temperature 0)."""
    if params is not None and not isinstance(params, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {type(params).__name__}")
    if params is None or params.greedy:
        return None
    return Sampler(params, positions, device)


def choose_in_tree(logits: torch.Tensor, tokens: torch.Tensor, tree, sampler: Sampler | None,
                   at: int, topk: torch.Tensor | None = None, rules=None,
                   generated: list[int] | None = None) -> torch.Tensor:
    """What each verified node emits, for `accept_greedy`: the argmax when greedy, else samples.

    logits: [n, V], tokens: [n] drafted (root first), tree: `parent` [n] and `depth` [n] (a
    CompiledTree); `at` = tokens committed before this step -> [n] int64. When sampling, only the
    nodes acceptance can reach are sampled, one level at a time (root; then the children whose
    token equals their parent's sample; ...); the others get -1, which no child token equals, so
    `accept_greedy` returns exactly what it would with every node sampled, for (accepted depth + 1)
    small batches instead of n full-vocabulary rows.
    Example: tokens [5, 7, 9, 3], paths [[0], [1], [0, 0]], samples root -> 7, node 1 -> 4:
    node 2 (9) and node 3 (3) are never sampled -> [7, 4, -1, -1].
    topk: [n, k] the nodes' top-k ids where the forward computed them (column 0 = the argmax).
    rules: a request's LogitRules (engine/tr/rules.py), applied per node at its own output position;
    where they read the tokens before (penalties), each node's are `generated` + its path's drafts, and
    only the reachable nodes are chosen, as when sampling.
    """
    paths = rules is not None and rules.reads_context
    if sampler is None and not paths:
        return choose(logits, None, at + tree.depth if rules is not None else at, topk, rules)
    parent, tok = tree.parent.tolist(), tokens.tolist()
    children: list[list[int]] = [[] for _ in tok]
    for node in range(1, len(tok)):
        children[parent[node]].append(node)
    choices = torch.full_like(tokens, -1)  # [n]
    frontier = [0]
    while frontier:
        index = torch.tensor(frontier, device=logits.device)  # [f]
        contexts = [generated + _path_tokens(u, parent, tok) for u in frontier] if paths else None
        picked = choose(logits[index], sampler, at + tree.depth[index], rules=rules, contexts=contexts)  # [f]
        choices[index] = picked
        frontier = [c for u, x in zip(frontier, picked.tolist()) for c in children[u] if tok[c] == x]
    return choices


def _path_tokens(node: int, parent: list[int], tokens: list[int]) -> list[int]:
    """The drafted tokens on the path root -> node, the root's excluded (it is committed already)."""
    path = []
    while node:
        path.append(tokens[node])
        node = parent[node]
    return path[::-1]


def choose(logits: torch.Tensor, sampler: Sampler | None, positions: torch.Tensor | int,
           topk: torch.Tensor | None = None, rules=None, contexts: list[list[int]] | None = None) -> torch.Tensor:
    """The token each node emits: the argmax when greedy (sampler None), else the seeded sample.

    logits: [n, V]; positions: [n] (or one int for every row) output positions -> [n] int64.
    topk: [n, k] the rows' top-k ids where the forward computed them (column 0 = the argmax).
    rules: a request's LogitRules, applied first (the forward's top-k is then not the choice), with
    `contexts` [n] the output tokens before each row where they read them.
    """
    if rules is not None:
        logits, topk = rules.apply(logits, positions, contexts), None
        # only a grammar can forbid every id (with min_tokens banning the stops it leaves)
        dead = torch.isneginf(logits.max(dim=-1).values).nonzero().flatten() if rules.grammar is not None else ()
        if len(dead):
            at = positions if isinstance(positions, int) else int(positions[dead[0]])
            raise OutputStuck(f"no token is allowed at output token {at}: the request's structured output allows "
                              f"only stop tokens there and min_tokens={rules.min_tokens} forbids them",
                              why=f"no token allowed at output token {at}")
    if sampler is None:
        return topk[:, 0].long() if topk is not None else logits.argmax(dim=-1)
    if isinstance(positions, int):
        positions = torch.full((logits.shape[0],), positions, device=logits.device)
    return sampler.sample(logits, positions.to(sampler.uniforms.device))
