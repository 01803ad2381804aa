"""Online tree tuning: keep re-choosing the fastest subtree while serving.

Drafting is nearly free (one gather per level), verification is what costs. So every step drafts
the whole *universe* tree (e.g. the paper's 80 nodes) but verifies only the current subtree, cut
out by index; one step in `explore_every` (stretched so exploring stays within `explore_budget` of
the verification time) verifies the whole universe with full lookup chains and is recorded. Those
exploration records are unbiased samples of what any subtree would have accepted
(engine/tuning/records.py), so every `retune_every` new records the optimiser (engine/tuning/optimise.py) picks
the subtree and chain caps that maximise tokens/s under the calibrated cost curve. Because the
matrix session always drafts the universe, remote drafting (matrix service) needs no change when
the subtree changes.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..tr.tree import CompiledTree, TreeTemplate, get_compiled
from .calibrate import CostModel
from .optimise import tune
from .records import FIELDS, AcceptanceLog

log = logging.getLogger("trserve.engine")


@dataclass(frozen=True)
class AutoTuneConfig:
    universe: str = "paper"  # the tree drafted every step; subtrees of it are verified
    explore_every: int = 16  # at most one step in N verifies the whole universe and is recorded
    # ... and exploring may take at most this fraction of verification time (under the calibrated
    # cost; a universe forward can cost 10x a tuned one on CPU), so the interval stretches to
    # cost(universe) / (budget * cost(current tree)); None = always every `explore_every` steps
    explore_budget: float | None = 0.1
    retune_every: int = 256  # new exploration records between re-tunes
    min_records: int = 128  # no re-tune before this many records
    max_nodes: int = 48
    max_ngram: int = 4
    max_chain: int = 16
    window: int = 20_000  # most recent records kept

    def __post_init__(self) -> None:
        if self.explore_every < 2 or self.retune_every < 1 or self.min_records < 1:
            raise ValueError("explore_every must be >= 2, retune_every and min_records >= 1")
        if self.explore_budget is not None and not 0 < self.explore_budget <= 1:
            raise ValueError(f"explore_budget must be in (0, 1] or None, got {self.explore_budget}")
        if not 1 <= self.max_nodes <= 128 or not 0 <= self.max_ngram <= 8 or not 1 <= self.max_chain <= 32:
            raise ValueError("max_nodes in [1, 128], max_ngram in [0, 8], max_chain in [1, 32]")


@dataclass(frozen=True)
class StepPlan:
    """What one TR step verifies: `select` cuts `tree` out of the drafted universe (None = all of it)."""

    tree: CompiledTree
    select: torch.Tensor | None  # [tree.n] universe node indices, root first
    explore: bool


class OnlineTuner:
    """One tree's online tuning: the Decoder's own (tree "adaptive"), or one per tenant
    (`Decoder.new_tuner()`, kept by a TunerBook); shared by that tenant's requests, thread-safe."""

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
        self.on_retune = None  # called with this tuner after each re-tune (e.g. to persist its state)
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
        self.explore_every = self._explore_interval(template)

    def _explore_interval(self, current: TreeTemplate) -> int:
        """Steps between exploration steps: explore_every, stretched to keep within explore_budget."""
        c = self.config
        if c.explore_budget is None:
            return c.explore_every
        kv = self.cost.kv_lens[len(self.cost.kv_lens) // 2]  # a typical KV length of the calibration
        universe = self.cost.cost(self.universe.n + c.max_chain, kv)
        tuned = self.cost.cost(current.size + 1 + max(current.lookup, default=0), kv)
        return max(c.explore_every, int(np.ceil(universe / (c.explore_budget * tuned))))

    def plan(self) -> StepPlan:
        with self._lock:
            self._steps += 1
            if self._steps % self.explore_every == 0:
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
        if self.on_retune is not None:
            try:
                self.on_retune(self)
            except Exception:  # persisting is best effort; decoding goes on
                log.exception("saving the tuner state failed")
        return result.template

    # ---- state: the records and the chosen tree, to keep with the tenant's matrix ---------------
    def state(self) -> bytes:
        """The acceptance records and the current tree as a self-describing .npz blob."""
        buf = io.BytesIO()
        cur = self.current
        meta = {"universe": [list(p) for p in self.universe.template.paths], "paths": [list(p) for p in cur.paths],
                "lookup": list(cur.lookup), "total_steps": self.log.total_steps, "retunes": self.retunes}
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **self.log.arrays())
        return buf.getvalue()

    def restore(self, blob: bytes) -> None:
        """Load `state()` output; ValueError (nothing changed) if it is unreadable or for another universe."""
        try:
            with np.load(io.BytesIO(blob)) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                columns = {f: z[f] for f in FIELDS}
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise ValueError(f"unreadable tuner state: {e}") from None
        if [tuple(p) for p in meta.get("universe", [])] != list(self.universe.template.paths):
            raise ValueError("tuner state was recorded on another universe tree")
        template = TreeTemplate.from_paths("adaptive", meta["paths"], lookup=meta["lookup"])
        self.log.load(columns, meta.get("total_steps", 0))
        with self._lock:
            self._set_current(template)
            self.retunes = int(meta.get("retunes", 0))


class TunerBook:
    """One OnlineTuner per key (e.g. per tenant: acceptance differs by workload), least recently
    used dropped beyond `capacity`. With `states` (load(key) -> bytes | None, save(key, bytes)), a
    new tuner starts from the key's saved records and tree, and saves them after every re-tune and
    on `save_all` (worker shutdown): the worker keeps them next to the tenant's matrix (in Redis
    with it when configured)."""

    def __init__(self, factory, capacity: int = 256, states=None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._factory = factory
        self._states = states
        self._capacity = capacity
        self._tuners: OrderedDict[str, OnlineTuner] = OrderedDict()
        self._lock = threading.Lock()

    def _new(self, key: str) -> OnlineTuner:
        tuner = self._factory()
        if self._states is None:
            return tuner
        try:
            blob = self._states.load(key)
            if blob is not None:
                tuner.restore(blob)
                log.info("tuner %s restored: %d records, %d nodes", key, len(tuner.log), tuner.current.size)
        except Exception as e:  # a bad or unreachable state only costs re-learning
            log.warning("tuner %s starts fresh (saved state not usable: %s)", key, e)
        tuner.on_retune = lambda t: self._states.save(key, t.state())
        return tuner

    def get(self, key: str) -> OnlineTuner:
        with self._lock:
            tuner = self._tuners.pop(key, None)
        if tuner is None:
            new = self._new(key)  # may read the state store: not under the lock other tenants wait on
        with self._lock:
            if tuner is None:  # unless a concurrent first request of this key got there first
                tuner = self._tuners.pop(key, None) or new
            self._tuners[key] = tuner
            while len(self._tuners) > self._capacity:
                self._tuners.popitem(last=False)
            return tuner

    def save_all(self) -> None:
        """Save every tuner's state now (e.g. at shutdown); best effort."""
        if self._states is None:
            return
        with self._lock:
            tuners = list(self._tuners.items())
        for key, tuner in tuners:
            try:
                self._states.save(key, tuner.state())
            except Exception as e:
                log.warning("tuner %s not saved: %s", key, e)

    def __len__(self) -> int:
        return len(self._tuners)
