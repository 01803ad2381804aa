"""Acceptance statistics from real decoding: what the tree optimiser (engine/tuning/optimise.py) learns from.

One record per TR step, relative to the *base* tree (the static matrix tree the step used):
  node   deepest accepted base node (0 = none accepted); its root path is the accepted rank path
  kv     KV length before the step (verification cost grows with it)
  ngram  size of the prompt-lookup suffix match (0 = no proposal was verified)
  plen   proposal tokens verified (graft overlap + chain)
  run    leading proposal tokens the model confirmed
  graft  base node the chain hung from (its depth = proposal tokens already in the tree)
From these, the tokens a *different* tree would have committed on the same step are exact for any
subtree of the base tree and any chain no longer than `plen` (see engine/tuning/optimise.py).
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from ..tr.tree import TreeTemplate

FIELDS = ("node", "kv", "ngram", "plen", "run", "graft")


class AcceptanceLog:
    """A bounded window of step records for one base tree; thread-safe, cheap to append."""

    def __init__(self, template: TreeTemplate, max_steps: int = 50_000) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.template = template
        self._records: deque[tuple[int, int, int, int, int, int]] = deque(maxlen=max_steps)
        self._lock = threading.Lock()
        self.total_steps = 0  # including those that fell out of the window

    def record(self, node: int, kv: int, ngram: int = 0, plen: int = 0, run: int = 0, graft: int = 0) -> None:
        with self._lock:
            self._records.append((node, kv, ngram, plen, run, graft))
            self.total_steps += 1

    def __len__(self) -> int:
        return len(self._records)

    def load(self, columns: dict[str, np.ndarray], total_steps: int) -> None:
        """Replace the window with saved columns (as from `arrays`), keeping the newest that fit."""
        if set(columns) != set(FIELDS) or len({len(v) for v in columns.values()}) > 1:
            raise ValueError(f"saved acceptance records need the columns {FIELDS} of equal length")
        rows = np.stack([np.asarray(columns[f], dtype=np.int64) for f in FIELDS], axis=1)  # [steps, 6]
        with self._lock:
            self._records.clear()
            self._records.extend(tuple(int(x) for x in r) for r in rows)
            self.total_steps = max(int(total_steps), len(rows))

    def arrays(self) -> dict[str, np.ndarray]:
        """Column arrays, each [steps] int64."""
        with self._lock:
            table = np.array(self._records, dtype=np.int64).reshape(-1, len(FIELDS))  # [steps, 6]
        return {name: table[:, i] for i, name in enumerate(FIELDS)}
