"""Online tree tuning: keep re-choosing the fastest subtree while serving.

Drafting is nearly free (one gather per level), verification is what costs. So every step drafts
the whole *universe* tree (e.g. the paper's 80 nodes) but verifies only the current subtree, cut
out by index; one step in `explore_every` verifies the whole universe with full lookup chains and
is recorded. Those exploration records are unbiased samples of what any subtree would have
accepted (engine/acceptance.py), so every `retune_every` new records the optimiser
(engine/tune.py) picks the subtree and chain caps that maximise tokens/s under the calibrated
cost curve. Because the matrix session always drafts the universe, remote drafting (matrix
service) needs no change when the subtree changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.acceptance import AcceptanceLog
from engine.calibrate import CostModel
from engine.tree import CompiledTree, TreeTemplate, get_compiled
from engine.tune import tune

log = logging.getLogger("trserve.engine")


@dataclass(frozen=True)
class AutoTuneConfig:
    universe: str = "paper"  # the tree drafted every step; subtrees of it are verified
    explore_every: int = 16  # one step in N verifies the whole universe and is recorded
    retune_every: int = 256  # new exploration records between re-tunes
    min_records: int = 128  # no re-tune before this many records
    max_nodes: int = 48
    max_ngram: int = 4
    max_chain: int = 16
    window: int = 20_000  # most recent records kept

    def __post_init__(self) -> None:
        if self.explore_every < 2 or self.retune_every < 1 or self.min_records < 1:
            raise ValueError("explore_every must be >= 2, retune_every and min_records >= 1")
        if not 1 <= self.max_nodes <= 128 or not 0 <= self.max_ngram <= 8 or not 1 <= self.max_chain <= 32:
            raise ValueError("max_nodes in [1, 128], max_ngram in [0, 8], max_chain in [1, 32]")


@dataclass(frozen=True)
class StepPlan:
    """What one TR step verifies: `select` cuts `tree` out of the drafted universe (None = all of it)."""

    tree: CompiledTree
    select: torch.Tensor | None  # [tree.n] universe node indices, root first
    explore: bool


class OnlineTuner:
    """Shared by all requests of a Decoder; thread-safe."""

    def __init__(self, config: AutoTuneConfig, universe: TreeTemplate, start: TreeTemplate, cost: CostModel,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.cost = cost
        self.device, self.dtype = device, dtype
        self.universe = get_compiled(
            TreeTemplate.from_paths(f"{universe.name}+lookup", universe.paths,
                                    lookup=[config.max_chain] * config.max_ngram), device, dtype)
        self._index = {p: i for i, p in enumerate(universe.paths, start=1)}
        self.log = AcceptanceLog(self.universe.template, max_steps=config.window)
        self._lock = threading.Lock()
        self._steps = 0
        self._since_tune = 0
        self.retunes = 0
        self._set_current(start)

    @property
    def current(self) -> TreeTemplate:
        return self._current.tree.template

    def _set_current(self, template: TreeTemplate) -> None:
        missing = [list(p) for p in template.paths if p not in self._index]
        if missing:
            raise ValueError(f"tree {template.name!r} is not a subtree of the universe: {missing[:3]} not in it")
        select = [0] + sorted(self._index[p] for p in template.paths)
        self._current = StepPlan(get_compiled(template, self.device, self.dtype),
                                 torch.tensor(select, device=self.device), explore=False)

    def plan(self) -> StepPlan:
        with self._lock:
            self._steps += 1
            if self._steps % self.config.explore_every == 0:
                return StepPlan(self.universe, None, explore=True)
            return self._current

    def recorded(self) -> None:
        """Called after an exploration step was recorded into `self.log`; re-tunes when due."""
        with self._lock:
            self._since_tune += 1
            due = self._since_tune >= self.config.retune_every and len(self.log) >= self.config.min_records
            if due:
                self._since_tune = 0
        if due:
            self.retune()

    def retune(self) -> TreeTemplate:
        t0 = time.perf_counter()
        c = self.config
        result = tune(self.log.arrays(), self.universe.template, self.universe.path_nodes.cpu().numpy(), self.cost,
                      name="adaptive", max_nodes=c.max_nodes, max_ngram=c.max_ngram)
        with self._lock:
            self._set_current(result.template)
            self.retunes += 1
        log.info("re-tuned in %.2fs from %d records: %d nodes, lookup %s, predicted %.1f tok/s MAT %.2f",
                 time.perf_counter() - t0, len(self.log), result.template.size, list(result.template.lookup),
                 result.tokens_per_s, result.mat)
        return result.template


class TunerBook:
    """One OnlineTuner per key (e.g. per tenant: acceptance differs by workload), least recently
    used dropped beyond `capacity`. The records live with the worker process, not in the matrix store."""

    def __init__(self, factory, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._factory = factory
        self._capacity = capacity
        self._tuners: OrderedDict[str, OnlineTuner] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> OnlineTuner:
        with self._lock:
            tuner = self._tuners.pop(key, None) or self._factory()
            self._tuners[key] = tuner
            while len(self._tuners) > self._capacity:
                self._tuners.popitem(last=False)
            return tuner

    def __len__(self) -> int:
        return len(self._tuners)
