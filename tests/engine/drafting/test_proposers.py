"""Issue 43, item 2: a draft method is one proposer (engine/drafting/proposers/). This file adds one, a toy that
drafts the request's last tokens again as a chain, without touching any engine file: the drafter asks
it first, the budget prices its options, the engine verifies its drafts and hands it their outcomes,
and the output stays plain decoding's."""

from __future__ import annotations

import torch

from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.drafting.budget.choose import PLAIN, Option
from trserve.engine.drafting.proposers import PROPOSERS, Offer, StepInfo
from trserve.engine.drafting.step import SOURCES, Draft
from trserve.engine.tuning.online import StepPlan


class Echo:
    """Drafts the request's last `n` committed tokens again after its root: right on repetitive text."""

    name = "echo"
    n = 3

    def __init__(self, budget, shapes) -> None:
        self.budget, self.shapes = budget, shapes
        self.learnt: list[tuple[int, int]] = []  # (drafted, accepted) per verified draft

    def takes(self, seq) -> bool:
        return len(seq.generated) >= self.n

    def start(self, seq) -> None:
        return None

    def offer(self, seq, step: StepInfo) -> Offer:
        chain = seq.generated[-self.n:]
        options = [PLAIN, Option(1 + len(chain), 1.5, 1 + len(chain))]  # plain, or the chain
        return Offer(self.budget.price(seq, options, step), lambda option: self._draft(seq, chain))

    def _draft(self, seq, chain: list[int]) -> Draft:
        tree = self.shapes.of_parents(seq.drafting.tree.template, [0] + list(range(len(chain))))  # a chain from the root
        tokens = torch.tensor([seq.root, *chain], dtype=torch.long, device=self.shapes.device)
        context = SOURCES.index("context")
        return Draft(tokens, tree, StepPlan(tree, None, explore=False), None, (0,) + (context,) * len(chain))

    def learn(self, seq, draft, acc, past) -> None:
        self.learnt.append((draft.tokens.shape[0] - 1, len(acc.path) - 1))


def test_a_toy_proposer_in_one_file_drafts_and_learns_and_the_output_is_plain_decodings(decoder):
    from trserve.engine import GenerationRequest

    engine = BatchEngine(decoder, EngineConfig(max_batch=2), cost=lambda w, kv: 1.0)  # free rows: drafts pay
    echo = Echo(engine.budget, engine.drafter.shapes)
    engine.drafter.proposers.insert(0, echo)  # registered first: it takes every request it can
    request = GenerationRequest(messages=[{"role": "user", "content": "Repeat 'la la la' ten times."}],
                                max_new_tokens=40, mode="tr")
    tr = engine.generate(decoder.prepare(request), tenant="echo")
    ar = engine.generate(decoder.prepare(GenerationRequest(messages=request.messages, max_new_tokens=40, mode="ar")))
    assert tr.ids == ar.ids  # lossless whatever a proposer drafts
    assert echo.learnt and sum(a for _, a in echo.learnt) > 0  # its drafts were verified, some accepted
    assert tr.stats.drafted.get("context", 0) == sum(d for d, _ in echo.learnt)
    assert tr.stats.steps < len(tr.ids)  # accepted drafts saved steps
    assert [p.name for p in engine.drafter.proposers] == ["echo"] + [p.name for p in (cls(None, None) for cls in PROPOSERS)]
