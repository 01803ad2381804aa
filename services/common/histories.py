"""Every tenant's suffix memory, in an embedded worker's store or in the matrix service's (which hands
it to replica workers: GetHistory, PushHistory) (engine/tr/history.py): one SuffixHistory per
(model fingerprint, tenant), never shared between tenants, kept in memory up to a byte bound (least
recently used dropped first) and persisted as the store's side state "history" (in Redis with the
tenant's matrix when the store has Redis; deleted with the tenant).

A history is loaded when its tenant's first request opens a session (on the caller's thread). The
engine hands finished requests over on its own thread, so `remember` only queues them: one thread
of the book adds them, and saves a tenant's history when `save_every_adds` requests or
`save_every_s` seconds have passed since its last save (a full history is a blob of up to ~256 KB:
not one write per request), when it is dropped from memory, and on `close` (shutdown). Loading or
saving failures are logged (throttled) and only cost what the history would have drafted.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ...core.errors import Unavailable
from ...engine.tr.history import SuffixHistory
from ...matrix_store import MatrixStore
from .throttle import Throttle as _Throttle

SIDE_STATE = "history"  # the store's side-state name of a tenant's history
_THROTTLE = _Throttle()
Key = tuple[str, str]  # (model fingerprint, tenant)


@dataclass(eq=False)
class _Entry:
    history: SuffixHistory
    nbytes: int  # its memory_bytes() when last measured
    saved_at: float  # clock() of its last save (or load)
    adds: int = 0  # requests added since then


class HistoryBook:
    """The histories of one store's tenants (see the module docstring); thread-safe."""

    def __init__(self, store: MatrixStore, max_bytes: int = 64 << 20, max_tokens: int = 65536,
                 save_every_s: float = 60.0, save_every_adds: int = 64, max_queue: int = 1024,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1 or save_every_adds < 1 or max_queue < 1:
            raise ValueError("max_bytes, save_every_adds and max_queue must be >= 1")
        self.store, self.max_bytes, self.max_tokens = store, max_bytes, max_tokens
        self.save_every_s, self.save_every_adds, self._clock = save_every_s, save_every_adds, clock
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self._saving: dict[Key, SuffixHistory] = {}  # dropped from memory, their save not done yet
        self._total = 0  # sum of the entries' nbytes
        self._lock = threading.Lock()
        self._tasks: queue.Queue = queue.Queue(max_queue)
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the request path ------------------------------------------------------------------------
    def get(self, fingerprint: str, tenant: str) -> SuffixHistory:
        """The tenant's history: in memory, else loaded from the store's side state, else empty."""
        key = (fingerprint, tenant)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.history
            history = self._saving.get(key)
        history = history or self._load(key)  # reads the store (maybe Redis): not under the lock
        with self._lock:
            entry = self._entries.get(key)  # unless a concurrent first request got there first
            if entry is None:
                entry = self._entries[key] = _Entry(history, history.memory_bytes(), self._clock())
                self._total += entry.nbytes
            self._entries.move_to_end(key)
            dropped = self._trim()
        self._save_dropped(dropped)
        return entry.history

    def _load(self, key: Key) -> SuffixHistory:
        try:
            blob = self.store.side_state(SIDE_STATE, key[0], key[1])
            if blob is not None:
                return SuffixHistory.from_bytes(blob, max_tokens=self.max_tokens)
        except Exception as exc:  # noqa: BLE001 - unreadable or corrupt: start afresh (saves replace it)
            _THROTTLE.failed("history load", key[1], exc, "starting an empty one")
        return SuffixHistory(self.max_tokens)

    def remember(self, fingerprint: str, tenant: str, history: SuffixHistory, tokens: Sequence[int]) -> None:
        """Queue one finished request's tokens for `history` (the one `get` gave this tenant); O(1)
        for the caller. Dropped, and logged, when the book's thread is that far behind."""
        task = ((fingerprint, tenant), history, list(tokens))
        if self._closed:
            self._add(*task)
            return
        self._start()
        try:
            self._tasks.put_nowait(task)
        except queue.Full:
            _THROTTLE.failed("history add", tenant, Unavailable("the history queue is full"), "request not kept")

    def add(self, fingerprint: str, tenant: str, history: SuffixHistory, tokens: Sequence[int]) -> None:
        """`remember` at once, on the caller's thread (the matrix service's PushHistory, off its loop)."""
        self._add((fingerprint, tenant), history, list(tokens))

    # -- the book's thread -----------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trserve-history", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                self._add(*task)
            except Exception as exc:  # noqa: BLE001 - bad tokens: the request is not kept, nothing else
                _THROTTLE.failed("history add", task[0][1], exc, "request not kept")
            finally:
                self._tasks.task_done()

    def _add(self, key: Key, history: SuffixHistory, tokens: list[int]) -> None:
        history.add(tokens)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.history is not history:
                return  # dropped from memory (and saved) since the request opened: this request is not kept
            nbytes = history.memory_bytes()
            self._total += nbytes - entry.nbytes
            entry.nbytes, entry.adds = nbytes, entry.adds + 1
            self._entries.move_to_end(key)
            due = entry.adds >= self.save_every_adds or self._clock() - entry.saved_at >= self.save_every_s
            if due:
                entry.adds, entry.saved_at = 0, self._clock()
            dropped = self._trim()
        if due:
            self._save(key, history)
        self._save_dropped(dropped)

    # -- memory bound and saving -----------------------------------------------------------------
    def _trim(self) -> list[tuple[Key, SuffixHistory]]:
        """Drop least recently used entries (never the newest) beyond max_bytes; returns those with
        unsaved requests, which the caller saves outside the lock. Under the lock."""
        dropped = []
        while self._total > self.max_bytes and len(self._entries) > 1:
            key, entry = self._entries.popitem(last=False)
            self._total -= entry.nbytes
            if entry.adds:
                self._saving[key] = entry.history
                dropped.append((key, entry.history))
        return dropped

    def _save_dropped(self, dropped: list[tuple[Key, SuffixHistory]]) -> None:
        for key, history in dropped:
            self._save(key, history)
            with self._lock:
                if self._saving.get(key) is history:
                    del self._saving[key]

    def _save(self, key: Key, history: SuffixHistory) -> None:
        try:
            self.store.save_side_state(SIDE_STATE, key[0], key[1], history.to_bytes())
        except Exception as exc:  # noqa: BLE001 - side state is an optimisation
            _THROTTLE.failed("history save", key[1], exc, "its history is kept in memory only")

    def flush(self) -> None:
        """Wait until every request queued so far is added (tests; shutdown)."""
        if self._thread is not None:
            self._tasks.join()

    def close(self) -> None:
        """Add what is queued, stop the thread, save every history with unsaved requests (shutdown);
        `remember` adds at once afterwards."""
        self.flush()
        self._closed = True
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join()
            self._thread = None
        with self._lock:
            dirty = [(k, e.history) for k, e in self._entries.items() if e.adds]
            for _, e in self._entries.items():
                e.adds = 0
        for key, history in dirty:
            self._save(key, history)

    # -- reporting -------------------------------------------------------------------------------
    def memory(self) -> list[tuple[str, str, int]]:
        """(fingerprint, tenant, bytes of its history) of every history in memory."""
        with self._lock:
            return [(fp, tenant, e.nbytes) for (fp, tenant), e in self._entries.items()]

    @property
    def memory_bytes(self) -> int:
        with self._lock:
            return self._total


class HistoryCollector(Collector):
    """A HistoryBook's histories in memory, read at scrape time: bytes per tenant and in all, beside
    the store's trserve_matrix_tenant_memory_bytes (an embedded worker's and the matrix service's)."""

    def __init__(self, book: HistoryBook) -> None:
        self._book = book

    def collect(self):
        rows = self._book.memory()
        yield GaugeMetricFamily("trserve_history_tenants", "Tenants whose suffix history is in memory",
                                value=len(rows))
        yield GaugeMetricFamily("trserve_history_memory_bytes", "Bytes of every tenant's suffix history in memory",
                                value=sum(nbytes for _, _, nbytes in rows))
        per = GaugeMetricFamily("trserve_history_tenant_memory_bytes", "Bytes of one tenant's suffix history in memory",
                                labels=["fingerprint", "tenant"])
        for fingerprint, tenant, nbytes in rows:
            per.add_metric([fingerprint, tenant], nbytes)
        yield per
