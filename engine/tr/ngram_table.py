"""The hash tables under `engine/tr/history.py`: n-gram hashes as a prepend chain (a context's
suffix hashes for every n in O(max_ngram), a document's in O(L * max_ngram) numpy work), and
open-addressing insertion (double hashing) where slots hold positions, not keys: a probe compares the
n tokens before the stored position with the query, so an answer is never a collision's garbage."""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_P, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_FEW = 48  # pending entries `insert` finishes one by one


def mix(h: int, token: int) -> int:
    """F(h, token) on one context token: splitmix64(h * P + token + 1), all mod 2^64."""
    z = (h * _P + token + 1) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def mix_array(h: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """F elementwise: h [m] uint64, tokens [m] uint64 -> [m] uint64 (numpy arrays wrap mod 2^64)."""
    z = h * np.uint64(_P) + tokens + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def doc_hashes(doc: np.ndarray, max_ngram: int) -> list[np.ndarray]:
    """doc [L] int32 -> per n = 1..max_ngram, [L - n + 1] uint64: the hash of doc[s: s + n] at s."""
    d = doc.astype(np.uint64)
    h = np.zeros(d.shape[0] + 1, np.uint64)  # h_0 of the empty n-gram at every s in [0, L]
    out = []
    for n in range(1, min(max_ngram, d.shape[0]) + 1):
        h = mix_array(h[1:], d[: d.shape[0] - n + 1])  # h_n[s] = F(h_{n-1}[s + 1], d[s])
        out.append(h)
    return out


def probe(h: int, mask: int) -> tuple[int, int]:
    """(first slot, odd stride) of a hash in a table of mask + 1 slots (double hashing)."""
    return h & mask, ((h >> 40) * 2 + 1) & mask


def insert(table: np.ndarray, buf: np.ndarray, rows: np.ndarray, ns: np.ndarray, hashes: np.ndarray,
            vals: np.ndarray) -> None:
    """Insert m n-grams: entry i is the ns[i]-gram ending before buffer position vals[i] (its hash
    hashes[i]) into table row rows[i]; rows, ns, vals [m] int64, hashes [m] uint64, table [N, S].

    Positions grow with recency, so for an n-gram already present the larger position wins: the
    most recent occurrence, whatever the order of the batch. Each round moves every pending entry
    one probe (claim an empty slot, update its own n-gram's slot, or step on): O(m * max_ngram)
    numpy work per round, rounds = the longest probe sequence (short: load <= 3/4, double hashing)."""
    size = table.shape[1]
    flat = table.reshape(-1)  # a view: [N * S]
    slot = (hashes & np.uint64(size - 1)).astype(np.int64)  # [m]
    stride = (((hashes >> np.uint64(40)) * np.uint64(2) + np.uint64(1)) & np.uint64(size - 1)).astype(np.int64)
    base = rows * size
    offsets = np.arange(-int(ns.max(initial=1)), 0)  # [W] the widest n-gram's token offsets
    pend = np.arange(vals.shape[0])
    while pend.size:
        if pend.size <= _FEW:  # the last few: one by one (a numpy round costs ~35 us however few it moves)
            for i in pend.tolist():
                _insert_one(flat, buf, int(base[i]), int(slot[i]), int(stride[i]), size - 1, int(ns[i]), int(vals[i]))
            return
        at = base[pend] + slot[pend]
        cur = flat[at].astype(np.int64)
        empty = cur < 0
        mine, took = pend[empty], at[empty]
        flat[took] = vals[mine]  # several may claim one slot: whichever write landed owns it
        lost = mine[flat[took] != vals[mine]]  # they look at the same slot again next round
        other, seen = pend[~empty], cur[~empty]
        cols = offsets >= -ns[other][:, None]  # [o, W] the columns inside each n-gram
        same = ((buf[np.maximum(seen[:, None] + offsets, 0)] == buf[np.maximum(vals[other][:, None] + offsets, 0)])
                | ~cols).all(axis=1)
        np.maximum.at(flat, at[~empty][same], vals[other[same]].astype(flat.dtype))
        step = other[~same]
        slot[step] = (slot[step] + stride[step]) & (size - 1)
        pend = np.concatenate([lost, step])


def _insert_one(flat: np.ndarray, buf: np.ndarray, base: int, slot: int, stride: int, mask: int, n: int,
                val: int) -> None:
    """`insert` for one entry: the n-gram ending before buffer position `val`, first slot `slot`."""
    gram = buf[val - n: val].tolist()
    while True:
        cur = int(flat[base + slot])
        if cur < 0:
            flat[base + slot] = val
            return
        if buf[cur - n: cur].tolist() == gram:
            flat[base + slot] = max(cur, val)
            return
        slot = (slot + stride) & mask
