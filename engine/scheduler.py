"""The engine's queues and KV budget: requests wait, are admitted to prefill, then run (running[i]
holds KV row i). Admission is by batch size and the KV tokens each request reserves (prompt +
max_new_tokens + its widest tree), and a tenant's queued prompt tokens are bounded; retirement frees
a row at once and compacts the rest.

Fair prefill: every admitted prompt holds an inactive KV row (rows active .. active + P - 1) and each
step prefills one chunk of one of them, the one with the fewest chunks left less the steps it has
waited since its last chunk (`pick_prefill`): a short prompt is not queued behind long ones (its first
token comes after at most one chunk of theirs); and a prompt that has waited max(4, P) steps goes
first (the longest waiting first), so a long one still gets a chunk every max(4, P) + 1 steps or
sooner, however many short ones arrive. A prompt whose prefill is done joins the batch at row
`active` (swapped there with the prompt in progress that held it).
Thread-safe where the callers' threads meet the engine thread (`enqueue`, `stop`, `wait_for_work`,
`all`); the rest runs on the engine thread."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..core.errors import ResourceExhausted
from .model.batch_kv import BatchKV
from .sequence import Sequence


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16  # sequences decoding at once (running + those prefilling)
    max_batch_tokens: int = 32768  # KV tokens the admitted sequences may reserve (prompt + max_new + tree)
    max_waiting: int = 64  # admitted beyond the budgets: wait; beyond this: ResourceExhausted
    # prompt tokens one tenant may have queued (waiting or prefilling, not yet prefilled): beyond, its next
    # request is ResourceExhausted (a tenant with nothing queued is always taken, however long its prompt)
    max_tenant_prompt_tokens: int = 16384
    prefill_chunk: int = 128  # prompt tokens prefilled per step
    batch_aware: bool = True  # trees sized per step for the batch; False = every sequence its full tree
    explore_every: int = 4  # batch-aware: at most every N * B steps one sequence (in turn) verifies its whole tree
    # ... and at most this share of the step time goes to those explorations (their extra width under the
    # calibrated costs: steep width costs, e.g. AVX2 CPUs, explore less often)
    explore_budget: float = 0.04
    # batch-aware: a step with trees must promise this much more than plain decoding (a share of tok/s) under
    # the cost model, whose calibration is noisy (engine/drafting/budget/choose.py)
    tree_margin: float = 0.05
    # prefix caching (engine/prefix_cache.py): MiB of finished sequences' keys and values kept for their
    # tenant's later prompts that start the same way (multi-turn chats, agent loops); 0 = off. Used
    # with the native forward only (its KV is the same bits whatever the forward's width)
    prefix_cache_mb: int = 512
    # shorter shared prefixes are prefilled again; 16 lets the chat template's system turn (24 tokens for
    # the bundled model) be reused: 36 Spec-Bench first turns of one tenant prefilled in 3.9 s against 4.8-5.4 s
    prefix_min_tokens: int = 16
    # TR under a grammar drafts its forced tokens and cuts the drafts it forbids (engine/drafting/constrained.py);
    # False verifies the unconstrained drafts (the A/B of `trserve bench --structured`)
    grammar_drafting: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_batch_tokens < 64 or self.max_waiting < 0 or self.prefill_chunk < 1:
            raise ValueError("max_batch >= 1, max_batch_tokens >= 64, max_waiting >= 0, prefill_chunk >= 1")
        if self.max_tenant_prompt_tokens < 1:
            raise ValueError(f"max_tenant_prompt_tokens must be >= 1, got {self.max_tenant_prompt_tokens}")
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
        self.prefills: list[Sequence] = []  # admitted, prompts in progress: rows active .. active + P - 1
        self.running: list[Sequence] = []  # running[i].place.row == i
        self.reserved = 0  # KV tokens the admitted sequences reserve
        self._lock = threading.Condition()
        self._stop = False

    # ---- callers' threads -------------------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        """Raises ResourceExhausted when the request can never fit or the waiting queue is full."""
        if seq.reserved > self.config.max_batch_tokens:
            raise ResourceExhausted(f"the request needs {seq.reserved} KV tokens; this engine holds at most "
                                    f"{self.config.max_batch_tokens}: shorten the prompt or max_new_tokens")
        with self._lock:
            if len(self.waiting) >= self.config.max_waiting:
                raise ResourceExhausted(f"engine full: {len(self.running)} decoding, {len(self.waiting)} waiting "
                                        f"(max_waiting={self.config.max_waiting}); retry later or use another worker")
            self._check_tenant(seq)

    def _check_tenant(self, seq: Sequence) -> None:
        """ResourceExhausted where `seq`'s tenant already has prompts queued and `seq`'s would take it
        past max_tenant_prompt_tokens (under the lock)."""
        queued = sum(x.prompt_len - x.place.done for x in (*self.prefills, *self.waiting) if x.tenant == seq.tenant)
        bound = self.config.max_tenant_prompt_tokens
        if queued and queued + seq.prompt_len > bound:
            raise ResourceExhausted(f"tenant {seq.tenant or 'default'!r} has {queued} prompt tokens queued; with this "
                                    f"request's {seq.prompt_len} it would pass its bound of {bound} "
                                    "(max_tenant_prompt_tokens): retry when its earlier prompts have started")

    def enqueue(self, seq: Sequence) -> None:
        with self._lock:
            self._check_tenant(seq)  # again: another request of the tenant may have come in since
            self.waiting.append(seq)
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
        return bool(self.waiting or self.running or self.prefills)

    @property
    def prefilling(self) -> Sequence | None:
        """A prompt in progress (the one `pick_prefill` would take next), or None."""
        return min(self.prefills, key=self._urgency) if self.prefills else None

    def all(self) -> list[Sequence]:
        with self._lock:
            return self._everyone()

    def _everyone(self) -> list[Sequence]:
        return [*self.running, *self.prefills, *self.waiting]

    def clear(self) -> list[Sequence]:
        """Drop every request (after a failed step): returns them; the KV starts empty."""
        with self._lock:
            lives = self._everyone()
            self.running, self.prefills, self.waiting = [], [], deque()
        self.kv.reset()
        self.reserved = 0
        return lives

    # ---- the engine thread ------------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Admit the waiting requests at the head of the queue while they fit (each to prefill into a
        row of its own); returns the waiting requests that were cancelled or timed out meanwhile (the
        caller finishes them)."""
        gone = []
        with self._lock:
            while self.waiting:
                head = self.waiting[0]
                if head.stopping():
                    gone.append(self.waiting.popleft())
                    continue
                if len(self.running) + len(self.prefills) + 1 > self.config.max_batch or \
                        self.reserved + head.reserved > self.config.max_batch_tokens:
                    break
                self.waiting.popleft()
                head.place.row = self.kv.active + len(self.prefills)
                self.kv.open_row(head.place.row)
                self.reserved += head.reserved
                self.prefills.append(head)
        return gone

    def _urgency(self, seq: Sequence) -> tuple[int, int, float]:
        """Lower first. A prompt that has waited max(4, P) steps or more since its last chunk goes first,
        the longest waiting first; else the fewest chunks left less the steps waited; then arrival."""
        starved = max(4, len(self.prefills))
        if seq.place.prefill_waited >= starved:
            return 0, -seq.place.prefill_waited, seq.caller.t0
        return 1, seq.place.prefill_chunks_left - seq.place.prefill_waited, seq.caller.t0

    def next_chunk_s(self, seq: Sequence) -> float:
        """What `seq`'s next prefill chunk should take, at the rate its last chunk ran (chunks only get
        deeper); 0 before its first."""
        if not seq.place.prefill_token_s:
            return 0.0
        return seq.place.prefill_token_s * min(self.config.prefill_chunk, seq.prompt_len - seq.place.done)

    def longest_step_s(self, times: StepTimes, prompt_tokens: int | None = None) -> float:
        """How long a step may take now (what a caller's deadline must keep in hand): two decoding steps,
        or 1.5 full prefill chunks (deep in a long prompt one attends to more than the average) plus a
        decoding step; with `prompt_tokens` and no other prompt prefilling or waiting, the part it fills."""
        fill = 1.0
        if prompt_tokens is not None and not self.prefills and not self.waiting:
            fill = min(1.0, prompt_tokens / self.config.prefill_chunk)
        return max(2 * times.step_s, 1.5 * times.chunk_s * fill + times.step_s)

    def pick_prefill(self, chunk: int) -> Sequence | None:
        """The prompt to prefill a chunk of (at most `chunk` tokens) this step, or None; the others
        count a step waited."""
        for seq in self.prefills:
            seq.place.prefill_chunks_left = -(-(seq.prompt_len - seq.place.done) // chunk)
        seq = self.prefilling
        for other in self.prefills:
            other.place.prefill_waited = 0 if other is seq else other.place.prefill_waited + 1
        return seq

    def join(self, seq: Sequence) -> None:
        """`seq`'s prompt is in: it leaves the prompts in progress and runs, at row `active`."""
        active = self.kv.active
        if seq.place.row != active:  # the prompt in progress that holds row `active` takes seq's row
            holder = next(x for x in self.prefills if x.place.row == active)
            self.kv.swap_rows(seq.place.row, active)
            holder.place.row, seq.place.row = seq.place.row, active
        self.kv.activate(seq.place.row)
        self.prefills.remove(seq)
        self.running.append(seq)

    def drop_prefills(self, ahead=lambda seq: 0.0) -> list[Sequence]:
        """The prompts in progress that were cancelled, timed out or failed, or would time out by the end
        of their next chunk (`ahead(seq)` seconds): they leave, their rows to the others."""
        gone = [x for x in self.prefills if x.stopping(ahead(x))]
        for seq in gone:
            self.prefills.remove(seq)
            self.kv.open_row(seq.place.row)  # empty: nothing of it is read again
        if gone:
            self._compact_prefills()
        return gone

    def retire(self, done: list[Sequence]) -> None:
        """Free the KV rows of `done` (running sequences) and compact the rest onto rows 0..B-1."""
        for seq in done:
            row = self.running.index(seq)
            moved = self.kv.close_row(row)
            if moved is not None:
                self.running[row] = self.running[moved]
                self.running[row].place.row = row
            self.running.pop()
        if done:
            self._compact_prefills()

    def _compact_prefills(self) -> None:
        """The prompts in progress onto rows active .. active + P - 1 (those outside move into the gaps)."""
        targets = range(self.kv.active, self.kv.active + len(self.prefills))
        free = sorted(set(targets) - {x.place.row for x in self.prefills})
        for seq in self.prefills:
            if seq.place.row not in targets:
                row = free.pop(0)
                self.kv.move_row(seq.place.row, row)
                seq.place.row = row

    def release(self, seq: Sequence) -> None:
        """`seq` leaves the engine: its reservation returns to the budget."""
        if seq.reserved and seq.place.row >= 0:
            self.reserved -= seq.reserved
            seq.place.row = -1

    def mean_kv(self) -> int:
        """The running sequences' mean KV length: where the cost model is read this step."""
        b = len(self.running)
        return sum(self.kv.rows.lens[:b]) // max(b, 1)
