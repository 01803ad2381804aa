"""The engine's queues and KV budget: requests wait, one at a time is prefilled, then they run
(running[i] holds KV row i). Admission is by batch size and the KV tokens each request reserves
(prompt + max_new_tokens + its widest tree); retirement frees a row at once and compacts the rest.
Thread-safe where the callers' threads meet the engine thread (`enqueue`, `stop`, `wait_for_work`,
`all`); the rest runs on the engine thread."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from trserve.core.errors import ResourceExhausted
from trserve.engine.model.batch_kv import BatchKV
from trserve.engine.sequence import Sequence


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoding at once (running + the one prefilling)
    max_batch_tokens: int = 32768  # KV tokens the admitted sequences may reserve (prompt + max_new + tree)
    max_waiting: int = 64  # admitted beyond the budgets: wait; beyond this: ResourceExhausted
    prefill_chunk: int = 128  # prompt tokens prefilled per step
    batch_aware: bool = True  # trees sized per step for the batch; False = every sequence its full tree
    explore_every: int = 4  # batch-aware: at most every N * B steps one sequence (in turn) verifies its whole tree
    # ... and at most this share of the step time goes to those explorations (their extra width under the
    # calibrated costs: steep width costs, e.g. AVX2 CPUs, explore less often)
    explore_budget: float = 0.04
    # batch-aware: a step with trees must promise this much more than plain decoding (a share of tok/s) under
    # the cost model, whose calibration is noisy (engine/tuning/budget.py)
    tree_margin: float = 0.05
    # prefix caching (engine/prefix_cache.py): MiB of finished sequences' keys and values kept for their
    # tenant's later prompts that start the same way (multi-turn chats, agent loops); 0 = off. Used
    # with the native forward only (its KV is the same bits whatever the forward's width)
    prefix_cache_mb: int = 512
    # shorter shared prefixes are prefilled again; 16 lets the chat template's system turn (24 tokens for
    # the bundled model) be reused: 36 Spec-Bench first turns of one tenant prefilled in 3.9 s against 4.8-5.4 s
    prefix_min_tokens: int = 16
    # TR under a grammar drafts its forced tokens and cuts the drafts it forbids (engine/constrained.py);
    # False verifies the unconstrained drafts (the A/B of `trserve bench --structured`)
    grammar_drafting: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_batch_tokens < 64 or self.max_waiting < 0 or self.prefill_chunk < 1:
            raise ValueError("max_batch >= 1, max_batch_tokens >= 64, max_waiting >= 0, prefill_chunk >= 1")
        if self.explore_every < 1:
            raise ValueError(f"explore_every must be >= 1, got {self.explore_every}")
        if not 0 < self.explore_budget <= 1:
            raise ValueError(f"explore_budget must be in (0, 1], got {self.explore_budget}")
        if self.prefix_cache_mb < 0 or self.prefix_min_tokens < 1:
            raise ValueError("prefix_cache_mb must be >= 0 and prefix_min_tokens >= 1")
        if not 0 <= self.tree_margin < 1:
            raise ValueError(f"tree_margin must be in [0, 1), got {self.tree_margin}")


class StepTimes:
    """What the engine's steps take (EMAs, 0.2 a sample): a decoding step without a prompt chunk,
    and a step with a full prefill chunk in it. Each starts from a guess that its first sample
    replaces. Read by callers sizing deadline margins (any thread: plain floats)."""

    def __init__(self) -> None:
        self.step_s, self.chunk_s = 0.1, 0.3
        self._steps = self._chunks = 0

    def step(self, seconds: float) -> None:
        self.step_s = seconds if not self._steps else 0.8 * self.step_s + 0.2 * seconds
        self._steps += 1

    def chunk(self, seconds: float) -> None:
        self.chunk_s = seconds if not self._chunks else 0.8 * self.chunk_s + 0.2 * seconds
        self._chunks += 1


class Scheduler:
    """waiting -> prefilling -> running, within the batch size and the KV token budget."""

    def __init__(self, config: EngineConfig, kv: BatchKV) -> None:
        self.config, self.kv = config, kv
        self.waiting: deque[Sequence] = deque()
        self.prefilling: Sequence | None = None
        self.running: list[Sequence] = []  # running[i].row == i
        self.reserved = 0  # KV tokens the admitted sequences reserve
        self._lock = threading.Condition()
        self._stop = False

    # ---- callers' threads -------------------------------------------------------------------------
    def check_fits(self, live: Sequence) -> None:
        """Raises ResourceExhausted when the request can never fit or the waiting queue is full."""
        if live.reserved > self.config.max_batch_tokens:
            raise ResourceExhausted(f"the request needs {live.reserved} KV tokens; this engine holds at most "
                                    f"{self.config.max_batch_tokens}: shorten the prompt or max_new_tokens")
        with self._lock:
            if len(self.waiting) >= self.config.max_waiting:
                raise ResourceExhausted(f"engine full: {len(self.running)} decoding, {len(self.waiting)} waiting "
                                        f"(max_waiting={self.config.max_waiting}); retry later or use another worker")

    def enqueue(self, live: Sequence) -> None:
        with self._lock:
            self.waiting.append(live)
            self._lock.notify()

    def waiting_prompts(self, tenant: str) -> list:
        """The prompts (token ids) of `tenant`'s waiting requests, oldest first (any thread)."""
        with self._lock:
            return [x.prepared.ids for x in self.waiting if x.tenant == tenant]

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()

    def wait_for_work(self) -> bool:
        """Block until there is work (True) or the engine is stopped (False)."""
        with self._lock:
            while not self._stop and not self.busy:
                self._lock.wait()
            return not self._stop

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def all(self) -> list[Sequence]:
        with self._lock:
            return self._everyone()

    def _everyone(self) -> list[Sequence]:
        return [*self.running, *([self.prefilling] if self.prefilling else []), *self.waiting]

    def clear(self) -> list[Sequence]:
        """Drop every request (after a failed step): returns them; the KV starts empty."""
        with self._lock:
            lives = self._everyone()
            self.running, self.prefilling, self.waiting = [], None, deque()
        self.kv.reset()
        self.reserved = 0
        return lives

    # ---- the engine thread ------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Start prefilling the head of the queue if it fits; returns the waiting requests that were
        cancelled or timed out meanwhile (the caller finishes them)."""
        gone = []
        with self._lock:
            while self.waiting and self.waiting[0].stopping():
                gone.append(self.waiting.popleft())
            if self.prefilling is not None or not self.waiting:
                return gone
            head = self.waiting[0]
            if len(self.running) + 1 > self.config.max_batch or self.reserved + head.reserved > self.config.max_batch_tokens:
                return gone
            self.waiting.popleft()
        self.reserved += head.reserved
        head.row = self.kv.open_row()
        self.prefilling = head
        return gone

    def join(self, live: Sequence) -> None:
        """`live`'s prompt is in: it leaves prefilling and runs."""
        self.kv.activate(live.row)
        self.prefilling = None
        self.running.append(live)

    def drop_prefilling(self, ahead: float = 0.0) -> Sequence | None:
        """The sequence being prefilled, if it was cancelled or timed out, or would be by the end of its
        next chunk (`ahead` seconds): it leaves."""
        live = self.prefilling
        if live is None or not live.stopping(ahead):
            return None
        self.prefilling = None
        return live

    def retire(self, done: list[Sequence]) -> None:
        """Free the KV rows of `done` (running sequences) and compact the rest onto rows 0..B-1."""
        for live in done:
            row = self.running.index(live)
            moved = self.kv.close_row(row)
            if moved is not None:
                self.running[row] = self.running[moved]
                self.running[row].row = row
            self.running.pop()
        if done and self.prefilling is not None and self.prefilling.row != self.kv.active:
            self.kv.move_row(self.prefilling.row, self.kv.active)
            self.prefilling.row = self.kv.active

    def release(self, live: Sequence) -> None:
        """`live` leaves the engine: its reservation returns to the budget."""
        if live.reserved and live.row >= 0:
            self.reserved -= live.reserved
            live.row = -1

    def mean_kv(self) -> int:
        """The running sequences' mean KV length: where the cost model is read this step."""
        b = len(self.running)
        return sum(self.kv.rows.lens[:b]) // max(b, 1)
