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

Shared: a prompt is also kept the moment its prefill ends when a waiting prompt of its tenant shares
more of it than the cache holds (`share`): the n choices of one OpenAI request (one Generate each,
queued together) or a burst with one system turn prefill their common prefix once, the rest load it.

Bounded: entries are evicted least recently used once their bytes exceed `max_bytes`; an entry that
a newer one extends (the same tenant's previous turn) is dropped when the newer one comes. Entries
are never read across tenants. Engine thread only.

Pooled: an entry's keys and values live in fixed-size blocks of `block_tokens` columns, and an
evicted entry's blocks hold the next ones; at most `max_bytes` of them are ever allocated. Memory
fresh from the OS costs a page fault per 4 KiB the first time it is written (~2.6 ms/MB measured on
a 2-core VM), and glibc hands chunks this large back to the OS when they are freed. With one tensor
per entry, storing finished requests took 140-304 us per decode step at eight concurrent requests
in a long-running engine after its first run; with the blocks, 120-148 us (copies only; the
concurrency bench, docs/benchmarks.md).

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
    tokens: np.ndarray  # [L] int64: the tokens whose keys and values `blocks` hold, in order
    blocks: tuple[torch.Tensor, ...]  # ceil(L / B) of [2, layers, Hkv, B, D]: keys then values, columns in order

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.blocks) + self.tokens.nbytes

    @property
    def kv(self) -> torch.Tensor:
        """[2, layers, Hkv, L, D]: the entry as one tensor (a copy; for checks, not the engine)."""
        return torch.cat(self.blocks, dim=3)[:, :, :, : self.tokens.shape[0]]


def copy_into_blocks(blocks: list[torch.Tensor] | tuple[torch.Tensor, ...], src: torch.Tensor, n: int) -> None:
    """src [2, layers, Hkv, >= n, D] (any strides) -> its first n columns into `blocks` ([.., B, D] each)."""
    width = blocks[0].shape[3]
    for i, block in enumerate(blocks):
        s = i * width
        e = min(n, s + width)
        block[:, :, :, : e - s].copy_(src[:, :, :, s:e])


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

    def __init__(self, max_bytes: int, min_tokens: int = 16, block_tokens: int = 64) -> None:
        if max_bytes < 0 or min_tokens < 1 or block_tokens < 1:
            raise ValueError("max_bytes must be >= 0, min_tokens and block_tokens >= 1")
        self.max_bytes, self.min_tokens, self.block_tokens = max_bytes, min_tokens, block_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()  # oldest use first
        self._next = 0
        self.bytes = 0  # held by entries (their blocks and tokens)
        self._free: list[torch.Tensor] = []  # blocks of evicted entries, for the next ones
        self._block: tuple | None = None  # (shape, dtype, device) of every block
        self.allocated = 0  # bytes of blocks ever allocated and not released: held or free, <= max_bytes
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
        """Keep `kv` [2, layers, Hkv, L, D] of `tokens` [L] for `tenant` (copied into the cache's
        blocks). Entries of the tenant that this one extends (or equals) go; the least recently used go
        while over `max_bytes`. Returns whether it was kept (not when shorter than `min_tokens` or
        larger than the whole cache)."""
        if len(tokens) != kv.shape[3]:
            return False
        return self._store(tenant, tokens, kv)

    def _store(self, tenant: str, tokens: list[int], src: torch.Tensor) -> bool:
        """store() from src [2, layers, Hkv, >= L, D] (any strides): its first L columns."""
        ids = np.asarray(tokens, dtype=np.int64)
        n = ids.shape[0]
        if n < self.min_tokens:
            return False
        shape = (*src.shape[:3], self.block_tokens, src.shape[4])
        if self._block != (shape, src.dtype, src.device):  # another model's KV (never within one engine)
            self.clear()
            self._block = (shape, src.dtype, src.device)
        block_bytes = int(np.prod(shape)) * src.element_size()
        count = -(-n // self.block_tokens)
        if count * block_bytes + ids.nbytes > self.max_bytes:
            return False
        for key in [k for k, e in self._entries.items() if e.tenant == tenant and e.tokens.shape[0] <= n
                    and common_prefix(e.tokens, ids) == e.tokens.shape[0]]:
            self._drop(key)
        # room: the least recently used go until the entry fits the bytes bound and its blocks can be
        # had without allocating past it (free blocks first, new ones within max_bytes)
        while self._entries and (self.bytes + count * block_bytes + ids.nbytes > self.max_bytes or
                                 len(self._free) + (self.max_bytes - self.allocated) // block_bytes < count):
            self._drop(next(iter(self._entries)))
        blocks = [self._free.pop() if self._free else self._new(shape, src) for _ in range(count)]
        copy_into_blocks(blocks, src, n)
        entry = PrefixEntry(tenant, ids, tuple(blocks))
        self._entries[self._next] = entry
        self._next += 1
        self.bytes += entry.nbytes
        return True

    def _new(self, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        block = torch.empty(shape, dtype=like.dtype, device=like.device)
        self.allocated += block.numel() * block.element_size()
        return block

    def reuse(self, tenant: str, prompt: list[int], kv, row: int) -> int:
        """Before a prompt's first chunk: the longest cached prefix of `tenant`'s that `prompt` starts
        with, loaded into empty KV `row` (engine/model/batch_kv.py:BatchKV). Returns the tokens reused."""
        hit = self.lookup(tenant, prompt)
        if hit is None:
            return 0
        kv.load_prefix(row, hit.entry.blocks, hit.tokens)
        return hit.tokens

    def keep(self, tenant: str, tokens: list[int], kv, row: int) -> None:
        """A running sequence about to leave: KV `row` under `tenant`. `tokens`: its prompt and committed
        tokens; column i of the row holds the i-th of them. The row may hold more than were committed
        (a last step's accepted path cut at max_new_tokens or a stop) and lacks the last one."""
        if row < 0:
            return
        n = min(kv.length(row), len(tokens))
        if n >= self.min_tokens:
            self._store(tenant, tokens[:n], kv.row_view(row))  # straight from the row into blocks

    def share(self, tenant: str, prompt: list[int], waiting: list, kv, row: int, cached: int) -> bool:
        """A prompt just prefilled into KV `row` (`cached` of its tokens came from here): its prefix that a
        waiting prompt of `tenant` (`waiting`: their ids) shares is kept now, not only when it leaves, if
        that is more than the cache already held for it (>= min_tokens): the choices of an n > 1 request,
        or a burst with one system turn, prefill their common prefix once (only that prefix is copied).
        Returns whether it was kept."""
        ids = np.asarray(prompt, dtype=np.int64)
        # what a waiting prompt would reuse: at most its length - 1 (its last token is always run)
        gain = max((min(common_prefix(ids, np.asarray(w, dtype=np.int64)), len(w) - 1) for w in waiting), default=0)
        if gain < self.min_tokens or gain <= cached or row < 0:
            return False
        return self._store(tenant, list(prompt[:gain]), kv.row_view(row))  # what they share: one copy, no more

    def clear(self, release: bool = True) -> None:
        """Every entry gone; release False: their blocks stay, free, for the next entries (no fresh
        memory to fault in), else the memory goes too."""
        if not release:
            for entry in self._entries.values():
                self._free.extend(entry.blocks)
        else:
            self._free.clear()
            self.allocated = 0
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
        self._free.extend(entry.blocks)
