"""Prefix caching: a finished request's keys and values, reused by a later prompt of the same tenant
that starts with the same tokens.

Multi-turn chats and agent loops re-send their whole context every turn: turn n's prompt is turn
n - 1's prompt, its answer and a little more. Prefilling that again costs most of such a request
(measured on the bundled repetitive workload, agent turn 2: 2.8 s of prefill against 1.1 s of TR
decoding). Here, when a sequence leaves the engine, its KV row (prompt + committed tokens but the
last) is copied out under its tenant; a new prompt of that tenant takes the longest cached prefix
it shares (at most its length - 1: the last prompt token is always run, for the first token's
logits) and prefills only the rest.

Exact, not approximate: the native forward computes every key and value with the same arithmetic
whatever the width of the forward that produced it (a 128-token prefill chunk, a one-token step, a
tree's chain), so cached entries are bit-identical to what a prefill would write
(tests/engine/test_prefix_cache.py checks the bits and the outputs). The engine uses the cache only
with that forward.

A TR request seeds its matrix from the model's predictions at its prompt's last positions
(`DecoderConfig.seed_from_prompt`); with a cached prefix only the positions it prefills seed it, and
only where the tenant's matrix lacks the token's row (measured: the same MAT with and without prompt
seeding on a warm tenant, docs/benchmarks.md).

Bounded: entries are evicted least recently used once their bytes exceed `max_bytes`; an entry that
a newer one extends (the same tenant's previous turn) is dropped when the newer one comes. Entries
are never read across tenants. Engine thread only.

Worked example, min_tokens 4: cached for tenant a: [1, 2, 3, 4, 5, 6]; a prompt [1, 2, 3, 4, 9] of
tenant a shares 4 tokens -> reuse 4, prefill [9]; the same prompt of tenant b -> nothing; a prompt
[1, 2, 3, 4, 5, 6] -> reuse 5 (its last token is run).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixEntry:
    tenant: str
    tokens: np.ndarray  # [L] int64: the tokens whose keys and values `kv` holds, in order
    kv: torch.Tensor  # [2, layers, Hkv, L, D]: keys then values of every layer

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.tokens.nbytes


@dataclass(frozen=True)
class PrefixHit:
    entry: PrefixEntry
    tokens: int  # how many leading tokens of the prompt the entry covers (its first `tokens` columns)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Finished sequences' KV per tenant, least recently used first out (see the module docstring)."""

    def __init__(self, max_bytes: int, min_tokens: int = 16) -> None:
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError("max_bytes must be >= 0 and min_tokens >= 1")
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest use first
        self._next = 0
        self.bytes = 0
        self.hits = self.misses = self.hit_tokens = 0  # lookups that reused a prefix / did not; tokens reused

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tenant: str, prompt: list[int]) -> PrefixHit | None:
        """The entry of `tenant` sharing the longest prefix with `prompt` (at least `min_tokens`, at most
        len(prompt) - 1 tokens), now the most recently used; None if none does."""
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_n = None, 0
        for key, entry in self._entries.items():
            if entry.tenant == tenant:
                n = min(common_prefix(entry.tokens, ids), ids.shape[0] - 1)
                if n > best_n:
                    best, best_n = key, n
        if best is None or best_n < self.min_tokens:
            self.misses += 1
            return None
        self._entries.move_to_end(best)
        self.hits += 1
        self.hit_tokens += best_n
        return PrefixHit(self._entries[best], best_n)

    def store(self, tenant: str, tokens: list[int], kv: torch.Tensor) -> bool:
        """Keep `kv` [2, layers, Hkv, L, D] of `tokens` [L] for `tenant`. Entries of the tenant that this
        one extends (or equals) go; the least recently used go while over `max_bytes`. Returns whether
        it was kept (not when shorter than `min_tokens` or larger than the whole cache)."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.shape[0] < self.min_tokens or ids.shape[0] != kv.shape[3]:
            return False
        entry = PrefixEntry(tenant, ids, kv)
        if entry.nbytes > self.max_bytes:
            return False
        for key in [k for k, e in self._entries.items() if e.tenant == tenant and e.tokens.shape[0] <= ids.shape[0]
                    and common_prefix(e.tokens, ids) == e.tokens.shape[0]]:
            self._drop(key)
        while self._entries and self.bytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = entry
        self._next += 1
        self.bytes += entry.nbytes
        return True

    def reuse(self, tenant: str, prompt: list[int], kv, row: int) -> int:
        """Before a prompt's first chunk: the longest cached prefix of `tenant`'s that `prompt` starts
        with, loaded into empty KV `row` (trserve/engine/model/batch_kv.py:BatchKV). Returns the tokens reused."""
        hit = self.lookup(tenant, prompt)
        if hit is None:
            return 0
        kv.load_prefix(row, hit.entry.kv, hit.tokens)
        return hit.tokens

    def keep(self, tenant: str, tokens: list[int], kv, row: int) -> None:
        """A running sequence about to leave: KV `row` under `tenant`. `tokens`: its prompt and committed
        tokens; column i of the row holds the i-th of them. The row may hold more than were committed
        (a last step's accepted path cut at max_new_tokens or a stop) and lacks the last one."""
        if row < 0:
            return
        n = min(kv.length(row), len(tokens))
        if n >= self.min_tokens:
            self.store(tenant, tokens[:n], kv.read_prefix(row, n))

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
