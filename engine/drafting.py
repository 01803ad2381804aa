"""What each running sequence verifies this step: its draft, from a static tree (cut to the size the
tree budget picked, with its lookup chain) or grown by confidence (engine/tr/dynamic.py), and the
rows its last steps recycled that its session has not taken yet."""

from __future__ import annotations

import time

import torch

from trserve.engine.constrained import constrained_draft
from trserve.engine.model.runner import RowInput
from trserve.engine.scheduler import Live
from trserve.engine.step import draft_step, grown_draft
from trserve.engine.tr.dynamic import CONTEXT, HISTORY, Chain, Grown, best_first_score, grow
from trserve.engine.tr.history import SuffixHistory
from trserve.engine.tr.lookup import ContextLookup, Proposal
from trserve.engine.tr.recycle import RecycledRows, distinct_rows
from trserve.engine.tr.tree import CompiledTree, TreeTemplate, compile_parents, get_compiled
from trserve.engine.tree_budget import TreeBudget
from trserve.engine.tuning.online import StepPlan


HAND_OVER = 16  # plain steps' rows a sequence growing no tree keeps before handing them to its session
MAX_SHAPES = 4096  # grown tree shapes kept compiled (the cache starts over when full)


class Drafter:
    """The drafting half of an engine step (engine thread only)."""

    def __init__(self, budget: TreeBudget, device: torch.device, dtype: torch.dtype, packed: bool) -> None:
        self.budget, self.device, self.dtype = budget, device, dtype
        self.packed = packed  # rows packed without pads (the native forward): a step costs its summed width
        self._plain: tuple[torch.Tensor, torch.Tensor] | None = None  # a plain row's depth [1] and mask [1, 1]
        self._trees: dict[tuple, CompiledTree] = {}  # grown trees' compiled shapes by parents (they recur)
        self._subtrees: dict[tuple[TreeTemplate, int], CompiledTree] = {}  # static trees cut to a size
        self.width = 1  # this step's forward width: summed (packed) or padded (the engine reports its time)

    def drafts(self, running: list[Live], steps: int, kv: int) -> tuple[list, list[RowInput], list[float]]:
        """Each running sequence's draft (None = plain decoding this step), its row input and the
        seconds its drafting took, with tree sizes chosen for the whole batch (engine/tree_budget.py)."""
        budget = self.budget
        budget.begin_step(running, steps, kv)
        # the least score a grown node needs: what pays in this batch; with whole trees (batch_aware off),
        # any node the grower takes
        grows = [self._grows(live) for live in running]
        floor = 0.0 if not budget.config.batch_aware else (budget.row_floor(kv, len(running)) if any(grows) else 1.0)
        staged, options = [], []
        for live, growing in zip(running, grows):
            if live.session is None:  # an AR-mode request
                staged.append(None)
                options.append([(1, 1.0, 1, 0)])
                continue
            if growing:
                grown = self._grow(live, floor)
                staged.append(grown)
                options.append(budget.grown_options(live, grown, len(running), kv))
                continue
            plan = live.seq.tuner.plan() if live.seq.tuner is not None else StepPlan(live.tree, None, explore=False)
            proposal, source = static_chain(live.seq.lookup, live.session.history,
                                            plan.tree.template.lookup)
            staged.append((plan, proposal, source))
            options.append(budget.options(live, plan, proposal, len(running), kv, source == HISTORY))
        chosen = budget.choose(options, kv)
        drafts, inputs, spent = [], [], []
        for live, stage, opts, j in zip(running, staged, options, chosen):
            t0 = time.perf_counter()
            _, _, size, chain = opts[j]  # chain: lookup tokens to verify (0: none)
            if stage is None or size == 1:
                draft = None
            elif isinstance(stage, Grown):
                tree = self._compiled(live.tree.template, stage.parent[:size])
                draft = grown_draft(stage, size, tree, self.device)
            else:
                draft = self._draft(live, *stage, size, chain)
            if stage is not None and live.seq.grammar is not None and budget.config.grammar_drafting:
                template = live.tree.template
                draft = constrained_draft(draft, live.seq.grammar, live.root, template.max_width - 1,
                                          lambda parent: self._compiled(template, parent))
            drafts.append(draft)
            inputs.append(self._plain_input(live.root) if draft is None
                          else RowInput(draft.tokens, draft.tree.depth, draft.tree.mask))
            spent.append(time.perf_counter() - t0)
        widths = [r.tokens.shape[0] for r in inputs]
        self.width = sum(widths) if self.packed else len(widths) * max(widths)
        return drafts, inputs, spent

    def _compiled(self, template, parent: list[int]) -> CompiledTree:
        """A grown tree's index tensors, compiled once per shape: most steps grow a shape seen before (a
        chain, a root with two children), and compiling one took ~0.13 ms of a ~9 ms step. Read only."""
        key = (template, tuple(parent))
        tree = self._trees.get(key)
        if tree is None:
            if len(self._trees) >= MAX_SHAPES:
                self._trees.clear()
            tree = self._trees[key] = compile_parents(template, parent, self.device, self.dtype)
        return tree

    def _grows(self, live: Live) -> bool:
        """Whether `live` drafts by growing trees from confidence: a dynamic tree, no tuner, and a
        session whose private copy holds the tenant's rows."""
        return live.session is not None and bool(live.tree.template.dynamic) and (
            live.seq.tuner is None and live.session.local_drafts)

    def _grow(self, live: Live, floor: float) -> Grown:
        """This step's grown tree for `live`, or its root alone when no node can score `floor` (the
        budget's row floor for this batch): the root's matrix row and the chains are checked first,
        and a chain source whose calibrated best is below the floor is not even looked up, so a plain
        step stays nearly as cheap as an AR one. A tree takes the session's pending rows first, so it
        drafts from them at once; plain steps hand them over only every HAND_OVER rows."""
        session, seq = live.session, live.seq
        m, template = session.matrix, live.tree.template
        rows, probs = m.host_views()  # [V, K] each
        calib = self.budget.rates.calibration(live)
        chains = []
        if calib.best_rate(CONTEXT) >= floor:
            chains.append(Chain.of(seq.lookup.propose(template.lookup), CONTEXT))
        if calib.best_rate(HISTORY) >= floor:
            chains.append(self._history(live))
        chains = [c for c in chains if c is not None]
        if best_first_score(rows, probs, live.root, calib, chains) * self.budget.trust(live) < floor:
            if len(live.plain) >= HAND_OVER:
                session.update(pending(live))
            return Grown([live.root], [0], [0], [-1], [1.0])
        session.update(pending(live))
        return grow(rows, probs, live.root, calib, chains, template.dynamic)

    def _history(self, live: Live) -> Chain | None:
        """A continuation from the tenant's earlier requests (its session's history), if it has one."""
        history = live.session.history
        if history is None:
            return None
        return Chain.of(history.propose(live.seq.lookup.tail(history.max_ngram), live.tree.template.dynamic), HISTORY)

    def _draft(self, live: Live, plan: StepPlan, proposal, source: int, size: int | None, chain: int):
        """What `live` verifies this step: its base tree cut to `size` nodes (None: the plan as it is)
        and `chain` tokens of its chain's proposal (from `source`). Only a sequence that verifies a tree
        drafts (and hands over its pending rows) this step: a plain step costs a TR request no more than
        an AR one."""
        drafted = live.session.step(pending(live), live.root)  # [n_draft]
        if size is not None and size < plan.tree.n:
            sub = self._subtree(plan.tree, size)
            plan = StepPlan(sub, torch.arange(sub.n, device=self.device), explore=False)
        if proposal is not None and chain and chain < len(proposal.tokens):
            proposal = Proposal(proposal.tokens[:chain], proposal.ngram)
        return draft_step(live.seq, drafted, plan, proposal, lookup=bool(chain), source=source)

    def _subtree(self, tree: CompiledTree, size: int) -> CompiledTree:
        """The first `size` nodes of `tree` (root included), compiled once (a prefix of a checked tree)."""
        key = (tree.template, size)
        if key not in self._subtrees:
            t = tree.template
            sub = TreeTemplate.from_paths(f"{t.name}/{size}", t.paths[: size - 1], t.description, t.lookup)
            self._subtrees[key] = get_compiled(sub, self.device, self.dtype)
        return self._subtrees[key]

    def _plain_input(self, root: int) -> RowInput:
        """One token at depth 0 seeing itself: the depth and mask are the same every step (read only)."""
        if self._plain is None:
            dev = self.device
            self._plain = (torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, 1, dtype=self.dtype, device=dev))
        return RowInput(torch.tensor([root], device=self.device), *self._plain)


def static_chain(lookup: ContextLookup, history: SuffixHistory | None, caps: tuple[int, ...]
                 ) -> tuple[Proposal | None, int]:
    """A static tree's chain (TreeTemplate.lookup: `caps`): the request's own proposal (`lookup`) or its
    tenant's `history`'s, whichever matched the longer suffix (a tie: the request's own), each cut to
    caps[n - 1] for its match size n, with the source it came from (CONTEXT or HISTORY). Sizes past
    the template's longest count as its longest, as the request's own are (the tuner's records too)."""
    own = lookup.propose(caps)
    if history is None or not caps or (own is not None and own.ngram >= len(caps)):  # nothing can match longer
        return own, CONTEXT
    earlier = history.propose(lookup.tail(history.max_ngram), max(caps))
    n = 0 if earlier is None else min(earlier.ngram, len(caps))
    if n == 0 or (own is not None and own.ngram >= n) or caps[n - 1] == 0:
        return own, CONTEXT
    return Proposal(earlier.tokens[:caps[n - 1]], n), HISTORY


def pending(live: Live) -> RecycledRows | None:
    """Takes the rows `live` has not handed to its session yet: its last tree step's, then its plain
    steps' (for a token in both, the later row wins); `live` holds none afterwards."""
    last, plain = live.recycled, live.plain
    live.recycled, live.plain = None, []
    if not plain:
        return last
    topk = torch.stack([r for _, r, _ in plain])  # [m, K]
    probs = torch.stack([p for _, _, p in plain])  # [m, K]
    tokens = torch.tensor([t for t, _, _ in plain], dtype=torch.long, device=topk.device)  # [m]
    if last is not None:  # engine rows always carry confidences (engine/tr/recycle.py)
        tokens, topk, probs = (torch.cat(pair) for pair in ((last.tokens, tokens), (last.topk, topk), (last.probs, probs)))
    return latest_rows(tokens, topk, probs)


def latest_rows(tokens: torch.Tensor, topk: torch.Tensor, probs: torch.Tensor) -> RecycledRows:
    """tokens [m], topk [m, K], probs [m, K] in step order -> one row per token: a repeated token's latest."""
    winners = distinct_rows(tokens, list(range(tokens.shape[0])))  # every row on the "path": the latest wins
    if winners is None:  # no token repeats (the usual case): no gathers
        return RecycledRows(tokens, topk, probs)
    return RecycledRows(*(torch.index_select(x, 0, winners) for x in (tokens, topk, probs)))
