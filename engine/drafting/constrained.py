"""Grammar-aware drafting (issue 44): what a sequence under a grammar (engine/tr/grammar.py) verifies.

- **Forced tokens.** Where the grammar allows only one continuation for the next bytes (a schema's
  keys, JSON punctuation), its canonical tokens are drafted as a chain from the root, instead of the
  matrix tree. Under the mask they are nearly certain to be accepted (the model may still spell the
  same bytes with other tokens, which verification sees like any miss).
- **Forbidden drafts.** Otherwise every drafted node whose token the grammar forbids after its path
  is cut, with its subtree, before the forward: a choice under the mask can never accept it, so its
  row would be wasted.

Either way acceptance is the one greedy rule under the mask, so the output is plain decoding's under
the same grammar. A draft changed here does not feed the tenant's acceptance rates (the budget's
model of the unconstrained trees)."""

from __future__ import annotations

import torch

from .step import Draft
from .dynamic import GRAMMAR
from ..tr.grammar import Grammar
from ..tuning.online import StepPlan


def constrained_draft(draft: Draft | None, grammar: Grammar, root: int, max_chain: int, compiled) -> Draft | None:
    """The draft a sequence under `grammar` verifies: its forced tokens after `root` as a chain (at most
    `max_chain`), else `draft` less the nodes the grammar forbids (None: plain decoding).
    compiled(parent: list[int]) -> CompiledTree of that shape."""
    forced = grammar.forced()[:max_chain]
    if forced:
        tokens = [root] + forced
        tree = compiled([0] + list(range(len(forced))))
        return Draft(torch.tensor(tokens, dtype=torch.long, device=tree.parent.device), tree,
                     StepPlan(tree, None, explore=False), None, (0,) + (GRAMMAR,) * len(forced), constrained=True)
    if draft is None:
        return None
    tokens = draft.tokens.tolist()
    parent = [0] + draft.tree.parent.tolist()[1:]
    depth = draft.tree.depth.tolist()
    paths: list[list[int] | None] = [[]] + [None] * (len(tokens) - 1)  # per node: its tokens after the root
    for i in sorted(range(1, len(tokens)), key=depth.__getitem__):  # parents first; None = cut
        above = paths[parent[i]]
        if above is not None and grammar.valid_prefix(above + [tokens[i]]) == len(above) + 1:
            paths[i] = above + [tokens[i]]
    kept = [i for i, p in enumerate(paths) if p is not None]
    if len(kept) == len(tokens):
        return draft
    kept.sort(key=lambda i: (len(paths[i]), i))  # parents before children
    index = {old: new for new, old in enumerate(kept)}
    tree = compiled([0] + [index[parent[i]] for i in kept[1:]])
    return Draft(draft.tokens[torch.tensor(kept, device=draft.tokens.device)], tree, StepPlan(tree, None, explore=False),
                 None, tuple(draft.source_of(i) for i in kept), constrained=True)

