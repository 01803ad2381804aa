"""One TR step of one sequence, split around the forward so that a batch can share it:
`draft_step` (what to verify) -> the forward (serial, in tests: tests/engine/model/serial_forward.py; batched:
engine/model/runner.py) -> `accept_step` (what to commit and recycle) -> the proposer's `learn`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sequence import Sequence
from ..tr.accept import Acceptance, accept_greedy
from .dynamic import CONTEXT, Grown
from .hybrid import Graft, graft, matched_run
from ..tr.lookup import Proposal
from ..tr.recycle import RecycledRows, recycle_rows, top_probs
from ..tr.sampling import choose_in_tree
from ..tr.tree import CompiledTree
from ..tuning.online import StepPlan
from ..tuning.records import AcceptanceLog


SOURCES = ("root", "matrix", "context", "history", "grammar")  # where a draft node came from: Draft.sources holds indices


@dataclass(frozen=True, repr=False)
class Draft:
    """What one sequence verifies this step."""

    tokens: torch.Tensor  # [n (+ chain)] root first
    tree: CompiledTree  # the tree verified (base + any lookup chain)
    plan: StepPlan  # the base tree (and, tuned, its cut from the drafted universe)
    grafted: Graft | None
    sources: tuple[int, ...] | None = None  # [n] index into SOURCES per node; None: base nodes matrix, chain context
    grown: Grown | None = None  # a tree grown by confidence (engine/drafting/dynamic.py): its first n nodes
    chain_source: int = CONTEXT  # where a static tree's grafted chain came from: CONTEXT or HISTORY
    constrained: bool = False  # changed by the request's grammar (engine/drafting/constrained.py): no rates learnt

    def source_of(self, node: int) -> int:
        if self.sources is not None:
            return self.sources[node]
        return 0 if node == 0 else 1 if node < self.plan.tree.n else self.chain_source

    def __repr__(self) -> str:
        return f"Draft(n={self.tokens.shape[0]}, base={self.plan.tree.n}, chain={self.grafted is not None})"


def draft_step(seq: Sequence, drafted: torch.Tensor, plan: StepPlan, proposal: Proposal | None = None,
               lookup: bool = True, source: int = CONTEXT) -> Draft:
    """drafted: [n_draft] the session's tree tokens -> the tokens and tree to verify. `proposal`: the
    chain if the caller already looked it up (else the context's, looked up here for the plan's tree),
    from `source` (an index into SOURCES); `lookup=False`: no chain this step."""
    base = plan.tree
    tokens = drafted if plan.select is None else drafted[plan.select]  # [n] the tree verified this step
    if not lookup:
        proposal = None
    elif proposal is None:
        proposal = seq.drafting.lookup.propose(base.template.lookup)
    if proposal is None:
        return Draft(tokens, base, plan, None)
    tokens, verify, grafted = graft(tokens, base, proposal.tokens, proposal.ngram)  # [n + chain]
    return Draft(tokens, verify, plan, grafted, chain_source=source)


def grown_draft(grown: Grown, width: int, tree: CompiledTree, device) -> Draft:
    """The first `width` nodes of a grown tree (`tree`: their compiled parents) as a draft."""
    tokens = torch.tensor(grown.tokens[:width], dtype=torch.long, device=device)  # [w]
    return Draft(tokens, tree, StepPlan(tree, None, explore=False), None, tuple(grown.source[:width]), grown)


def accept_step(seq: Sequence, draft: Draft, logits: torch.Tensor, k: int, topk: torch.Tensor | None = None,
                probs=top_probs) -> tuple[Acceptance, RecycledRows]:
    """logits: [n, V] of the draft's nodes (topk: their top-k ids [n, k] where the forward computed
    them; probs: those ids' confidences [n, k] where it computed them too, else what computes them)
    -> (accepted path and tokens, rows to recycle); counts the nodes per draft source. What the
    proposer that drafted it learns is its own (Proposer.learn)."""
    greedy = choose_in_tree(logits, draft.tokens, draft.tree, seq.sampler, len(seq.generated), topk,
                            seq.rules, seq.generated)  # argmax or samples, under the request's logit rules
    acc = accept_greedy(draft.tokens, greedy, draft.tree)
    rows = recycle_rows(draft.tokens, logits, k, acc.path, topk, probs)
    count_sources(seq, draft, acc.path)
    return acc, rows


def count_sources(seq: Sequence, draft: Draft, path: list[int]) -> None:
    """Per draft source, the nodes this step verified and accepted, into the sequence's counters."""
    if draft.tokens.shape[0] > 1:
        seq.draft_steps += 1
    for nodes, counts in ((range(1, draft.tokens.shape[0]), seq.drafted), (path[1:], seq.accepted)):
        for i in nodes:
            name = SOURCES[draft.source_of(i)]
            counts[name] = counts.get(name, 0) + 1


def record_step(log: AcceptanceLog, draft: Draft, acc: Acceptance, past: int) -> None:
    """A template tree's verified step into `log` (the tree optimiser's records): its deepest accepted
    base node, the KV length `past` it was verified after, and its grafted chain's outcome."""
    grafted = draft.grafted
    deepest = [i for i in acc.path if i < draft.plan.tree.n][-1]  # deepest accepted node of the base tree
    if grafted is None:
        log.record(deepest, past)
    else:
        log.record(deepest, past, grafted.ngram, len(grafted.proposal), matched_run(grafted.proposal, acc.tokens),
                   grafted.at)
