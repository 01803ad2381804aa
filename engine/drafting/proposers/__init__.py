"""Draft methods as proposers (vLLM's word), one file each, registered here.

A proposer (base.py:Proposer) says whether it drafts for a running TR request (`takes`), gives the
request's state it keeps for it (`start`), offers what the request could verify this step as options
priced by the tree budget (`offer` -> base.py:Offer, with each option's draft; the budget picks one
option per request for the whole batch) and learns from its verified outcome (`learn`). The drafter (engine/drafting/drafter.py) asks PROPOSERS in order, and it and the engine reach a
method only through that Protocol. A new draft method is one file here and one entry below
(tests/engine/drafting/test_proposers.py adds a toy one).

- grown.GrownTrees: trees grown by confidence (a dynamic tree template, no tuner, a local copy);
- tuned.TunedTree: the online tuner's plan (a request with a tuner);
- static.StaticTree: the request's static tree with a lookup chain (every other TR request).
"""

from .base import PLAIN_OFFER, Offer, Proposer, Shapes, StepInfo
from .grown import GrownTrees
from .static import StaticTree, static_chain
from .tuned import TunedTree

PROPOSERS = (GrownTrees, TunedTree, StaticTree)  # asked in this order: the first that takes a request drafts it

__all__ = ["PLAIN_OFFER", "PROPOSERS", "GrownTrees", "Offer", "Proposer", "Shapes", "StaticTree", "StepInfo", "TunedTree", "static_chain"]
