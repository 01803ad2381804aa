"""Suffix memory: continuations of the current suffix found in a tenant's earlier requests.

`engine/tr/lookup.py` finds spans a request copies from its own prompt; a tenant's requests also
repeat each other (the same system prompt, template, boilerplate answer). `SuffixHistory` keeps a
tenant's recent documents (one per finished request: prompt + output) and answers the same question
as `find_continuation` over them: the tokens that followed the most recent earlier occurrence of the
longest matching suffix, never across two documents.

Index: one open-addressing table per n-gram size n in [min_ngram, max_ngram], each slot the position
of the token that follows one n-gram (-1: empty; 4 bytes, no key: `engine/tr/ngram_table.py`).
The tables share one power-of-two size, at most 3/4 used.

Two generations, each its own tokens and tables: adds go to the younger one, in place (O(L * max_ngram)
numpy work, no copy of the index); once it would pass max_tokens / 2 tokens it becomes the older one,
and the older one is dropped whole: no rebuild. Within max_tokens, the oldest documents are evicted
logically first (the older generation's `live` moves past them). E.g. 65536 tokens, n in [3, 12]:
2 x 10 x 2^16 slots = 5 MiB, plus 4 bytes per token. Only a tenant's first generation grows its
tables, re-indexing itself at each doubling (the last, at ~24K tokens, ~50-80 ms once), so a small
history stays small. With 200-900-token documents: ~0.9 ms an add once full (was ~6 ms: a whole-index
copy per add, a rebuild every ~50 documents).
"""

from __future__ import annotations

import secrets
import struct
import threading
import zlib
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .lookup import Proposal
from .ngram_table import doc_hashes, insert, mix, probe

_MAX_LOAD = 0.75  # the tables are rebuilt larger before more slots than this are taken
_MIN_SLOTS = 256
_MAGIC, _FORMAT = b"TRSH", 1
_HEADER = struct.Struct("<4sHHIIQ")  # magic, format, reserved, documents, tokens, version
_MAX_TOKEN = (1 << 31) - 1


@dataclass(frozen=True)
class _Gen:
    """One generation of documents: its tokens and its n-gram index, positions counted from its start.
    Never changed where a reader can see: an add writes only past `buf`'s end (in `store`) and table
    slots for those positions, then publishes a new `_Gen` (see SuffixHistory)."""

    store: np.ndarray  # [C] int32: the generation's tokens, then room for more
    size: int  # tokens held: store[:size]
    ends: tuple[int, ...]  # end of each document, oldest first
    table: np.ndarray  # [N, S] int32, row n - min_ngram: the n-gram index (see the module docstring)
    versions: tuple[int, ...] = ()  # the history's version once each document was added (documents_since)

    @property
    def buf(self) -> np.ndarray:
        return self.store[: self.size]

    def room(self, incoming: int) -> bool:
        """Whether `incoming` more tokens fit its store and keep its tables at most 3/4 full."""
        total = self.size + incoming
        return total <= self.store.shape[0] and total <= _MAX_LOAD * self.table.shape[1]


@dataclass(frozen=True)
class _State:
    """What readers see: the older generation (None: none) with its first live position, and the
    younger one, which takes the adds."""

    old: _Gen | None
    live: int  # old.buf[:live] holds evicted documents
    young: _Gen
    gone: int = 0  # the newest version whose document the history no longer holds (0: none gone)


class SuffixHistory:
    """A bounded index of a tenant's recent documents (see the module docstring). Thread-safe:
    writers (add) are serialised; readers take no lock and see one published state, whose tokens an
    add never changes (see `_Gen`). A proposal racing an add in another thread may miss an n-gram
    whose slot the add moves to its newer occurrence (the engine adds and proposes on one thread)."""

    def __init__(self, max_tokens: int = 65536, max_ngram: int = 12, min_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not 1 <= max_tokens <= 1 << 28:
            raise ValueError(f"max_tokens must lie in [1, 2^28], got {max_tokens}")
        self.max_tokens, self.max_ngram, self.min_ngram = max_tokens, max_ngram, min_ngram
        self.generation = max(1, max_tokens // 2)  # a younger generation past this many tokens becomes the older
        self._write = threading.Lock()
        self._state = _State(None, 0, self._empty(0))
        self._version = 0
        # this object's identity in `documents_since`: a history rebuilt from a blob (a restart, a reload)
        # may reach a version it had before with other documents
        self.epoch = secrets.randbits(62) + 1

    # -- what it holds -----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Documents added since creation (restored with a blob)."""
        return self._version

    @property
    def tokens(self) -> int:
        st = self._state
        return st.young.size + (st.old.size - st.live if st.old is not None else 0)

    @property
    def documents(self) -> int:
        st = self._state
        return len(st.young.ends) + (len(st.old.ends) - bisect_right(st.old.ends, st.live) if st.old else 0)

    def memory_bytes(self) -> int:
        """Bytes held: both generations' token stores (evicted tokens included) and index tables,
        document lists, object."""
        st = self._state
        gens = [g for g in (st.old, st.young) if g is not None]
        return sum(int(g.store.nbytes + g.table.nbytes) + 40 * len(g.ends) for g in gens) + 512

    # -- adding ------------------------------------------------------------------------------
    def add(self, tokens: Sequence[int]) -> None:
        """Append one document (its last max_tokens tokens) to the younger generation; the oldest
        documents make room. ValueError for ids outside [0, 2^31). O(L * max_ngram) numpy work, in
        place: no copy of the index, and no rebuild once the first generation has grown its tables.
        When the younger generation would pass max_tokens / 2 tokens, it becomes the older one and the
        older one's documents go: the newest documents stay, about max_tokens / 2 to max_tokens tokens."""
        doc = _as_tokens(tokens)[-self.max_tokens:]
        hashes = doc_hashes(doc, self.max_ngram)  # depends on the document only
        n = doc.shape[0]
        with self._write:
            self._version += 1
            if n == 0:
                return
            st = self._state
            old, live, young, gone = st.old, st.live, st.young, st.gone
            if young.size and young.size + n > self.generation:  # rotate (the older one's documents go)
                gone = max((gone, *old.versions)) if old is not None else gone
                old, live, young = young, 0, self._empty(max(self.generation, n))
            while old is not None and old.size - live + young.size + n > self.max_tokens:  # oldest first
                i = bisect_right(old.ends, live)
                live, gone = old.ends[i], max(gone, old.versions[i])
            if old is not None and live == old.size:
                old, live = None, 0
            if not young.room(n):  # a first generation grows: re-indexed in new arrays (readers keep theirs),
                need = young.size + n  # with room for twice as much, up to a generation's tables
                young = self._built(young.buf, young.ends, max(min(2 * need, self.generation), need), young.versions)
            start = young.size
            young.store[start: start + n] = doc  # past every reader's buf
            entries = self._entries(start, hashes)
            if entries:  # () for a document of at most min_ngram tokens
                insert(young.table, young.store[: start + n], *entries)
            young = _Gen(young.store, start + n, young.ends + (start + n,), young.table, young.versions + (self._version,))
            self._state = _State(old, live, young, gone)

    def _empty(self, tokens: int) -> _Gen:
        """An empty generation with room for `tokens` tokens (0: the smallest tables)."""
        slots = _MIN_SLOTS
        while slots * _MAX_LOAD < tokens:
            slots *= 2
        table = np.full((self.max_ngram - self.min_ngram + 1, slots), -1, np.int32)
        return _Gen(np.zeros(max(tokens, _MIN_SLOTS // 2), np.int32), 0, (), table)

    def _built(self, buf: np.ndarray, ends: tuple[int, ...], room: int, versions: tuple[int, ...]) -> _Gen:
        """A new generation indexing the documents of `buf` (ends, versions: theirs), with room for `room` tokens."""
        gen = self._empty(max(room, buf.shape[0]))
        gen.store[: buf.shape[0]] = buf
        parts = [self._entries(s, doc_hashes(buf[s:e], self.max_ngram)) for s, e in zip((0,) + ends[:-1], ends)]
        parts = [p for p in parts if p]
        if parts:
            insert(gen.table, gen.store[: buf.shape[0]], *(np.concatenate(c) for c in zip(*parts)))
        return _Gen(gen.store, buf.shape[0], ends, gen.table, versions)

    def _entries(self, start: int, hashes: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        """(rows, ns, hashes, vals) of the document at buffer[start:] (see ngram_table.doc_hashes, insert)."""
        length = hashes[0].shape[0] if hashes else 0
        parts = []
        for n in range(self.min_ngram, len(hashes) + 1):
            m = length - n  # n-grams followed by a token of the same document
            if m > 0:
                parts.append((np.full(m, n - self.min_ngram), np.full(m, n), hashes[n - 1][:m],
                              start + n + np.arange(m, dtype=np.int64)))
        return tuple(np.concatenate(c) for c in zip(*parts)) if parts else ()

    # -- proposing ---------------------------------------------------------------------------
    def propose(self, context: Sequence[int], length: int) -> Proposal | None:
        """The tokens (at most `length`, within their document) that followed the most recent
        occurrence of the longest suffix of `context` of size n in [min_ngram, max_ngram] that occurs
        with a following token; None when there is none. Only the last max_ngram tokens are read.
        Sizes from min_ngram up, to the first absent one (one probe when nothing matches; <= n tokens
        compared, expected O(1) slots, per probe and generation).
        Example: documents [5, 1, 2, 3, 4] then [1, 2, 3, 9]; context [7, 1, 2, 3], min_ngram 2:
        the 3-gram [1, 2, 3] occurs in both, the newer wins -> Proposal([9], ngram=3)."""
        if length < 1:
            return None
        tail = [int(t) for t in context[-self.max_ngram:]]
        t = len(tail)
        if t < self.min_ngram:
            return None
        st = self._state  # one whole state, whatever an add publishes meanwhile
        # shortest first, each n-gram's hash from the last one's (the chain `doc_hashes` builds): a live
        # occurrence of the (n + 1)-gram ends with a live occurrence of its last n tokens, so the first
        # absent size ends the search, and most steps, matching nothing, stop at min_ngram (one probe
        # per generation); the younger generation's occurrences are the more recent
        # (the most recent occurrence of the n-gram, if it extends within its document, is the most recent
        # of the (n + 1)-gram too: one token compared instead of a probe, while it does)
        gen, h = None, 0  # the longest match so far: its generation, position after it, size, document span
        pos = size = start = end = 0
        for n in range(1, t + 1):
            h = mix(h, tail[t - n])
            if n < self.min_ngram:
                continue
            if gen is not None and pos - n >= start and int(gen.store[pos - n]) == tail[t - n]:
                size = n  # the same occurrence, one token longer
                continue
            gram = tail[t - n:]
            g, p = st.young, self._find(st.young, n, h, gram)
            if p < 0 and st.old is not None:
                g, p = st.old, self._find(st.old, n, h, gram)
                p = p if p > st.live else -1  # an evicted occurrence: every older one is too
            if p < 0:
                break
            doc = bisect_right(g.ends, p)
            gen, pos, size, start, end = g, p, n, g.ends[doc - 1] if doc else 0, g.ends[doc]
        if gen is None:
            return None
        return Proposal(gen.store[pos: min(pos + length, end)].tolist(), size)

    def _find(self, gen: _Gen, n: int, h: int, gram: list[int]) -> int:
        """Position in `gen` after the most recent occurrence of `gram` (size n) there, -1 when absent.
        A slot past `gen`'s tokens belongs to a newer add: skipped."""
        row, buf, size = gen.table[n - self.min_ngram], gen.store, gen.size
        mask = row.shape[0] - 1
        slot, stride = probe(h, mask)
        while (pos := int(row[slot])) >= 0:
            if pos <= size and buf[pos - n: pos].tolist() == gram:
                return pos  # the most recent one (in the old generation, maybe an evicted one)
            slot = (slot + stride) & mask
        return -1

    # -- persistence -------------------------------------------------------------------------
    def _live_documents(self, st: _State) -> tuple[np.ndarray, list[int]]:
        """(tokens [T] int32, document lengths) of what `st` holds, oldest first."""
        parts, lengths = [], []
        if st.old is not None:
            first = bisect_right(st.old.ends, st.live)
            starts = (st.live,) + st.old.ends[first:-1]
            lengths += [e - s for s, e in zip(starts, st.old.ends[first:])]
            parts.append(st.old.buf[st.live:])
        y = st.young
        lengths += [e - s for s, e in zip((0,) + y.ends[:-1], y.ends)]
        parts.append(y.buf)
        return np.concatenate(parts), lengths

    def to_bytes(self) -> bytes:
        """The live documents: header, zlib(document lengths <u4, tokens <i4), crc32 of all before it."""
        with self._write:  # the version of this state
            st, version = self._state, self._version
        tokens, lengths = self._live_documents(st)
        lengths = np.asarray(lengths, "<u4")
        header = _HEADER.pack(_MAGIC, _FORMAT, 0, lengths.shape[0], tokens.shape[0], version)
        body = header + zlib.compress(lengths.tobytes() + tokens.astype("<i4").tobytes(), 1)
        return body + struct.pack("<I", zlib.crc32(body))

    def documents_since(self, version: int, epoch: int) -> tuple[list[np.ndarray], int] | None:
        """(the documents added after `version` of this history (`epoch`), oldest first, as [L] int32
        arrays; the version now), or None when it no longer holds all of them (evicted, or `version` and
        `epoch` are not its own): what a replica that last saw `version` needs instead of the whole history."""
        with self._write:  # a state and its version
            st, now = self._state, self._version
        if epoch != self.epoch or not st.gone <= version <= now:
            return None
        docs = []
        for gen, first in ((st.old, st.live), (st.young, 0)):
            if gen is not None:
                for start, end, v in zip((0,) + gen.ends[:-1], gen.ends, gen.versions):
                    if start >= first and v > version:
                        docs.append(gen.store[start:end].copy())
        return docs, now

    @classmethod
    def from_bytes(cls, blob: bytes, max_tokens: int = 65536, max_ngram: int = 12,
                   min_ngram: int = 3) -> SuffixHistory:
        """A history holding the newest documents of `blob` that fit max_tokens (index rebuilt), the
        newest within max_tokens / 2 in the younger generation; `documents_since` answers only from its
        version on (the blob keeps no version per document). ValueError (never a partial history) when
        the blob is not a whole, intact one of this format."""
        lengths, tokens, version = _decode(bytes(blob))
        history = cls(max_tokens, max_ngram, min_ngram)
        ends = np.cumsum(lengths).tolist()
        keep, total = 0, 0
        for length in reversed(lengths.tolist()):  # newest first, as many whole ones as fit
            if total + length > max_tokens:
                break
            keep, total = keep + 1, total + length
        first = ends[len(ends) - keep - 1] if keep < len(ends) else 0
        if not keep and ends:  # the newest document alone is too long: its last max_tokens tokens, as add()
            first, keep = ends[-1] - max_tokens, 1
        kept = [e - first for e in ends[len(ends) - keep:]]
        buf = tokens[first:].astype(np.int32)
        # the younger generation: the newest documents within max_tokens / 2 (at least one); the older: the rest
        split = next((i for i in range(len(kept)) if kept[-1] - (kept[i - 1] if i else 0) <= history.generation),
                     max(len(kept) - 1, 0))
        cut = kept[split - 1] if split else 0
        young = history._built(buf[cut:], tuple(e - cut for e in kept[split:]), history.generation,
                               (version,) * (len(kept) - split))
        old = history._built(buf[:cut], tuple(kept[:split]), 0, (version,) * split) if split else None
        history._state = _State(old, 0, young, version)
        history._version = version
        return history


def _as_tokens(tokens: Sequence[int]) -> np.ndarray:
    """tokens as [L] int32; ValueError for ids outside [0, 2^31)."""
    arr = np.asarray(tokens if len(tokens) else [], dtype=np.int64).reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN):
        raise ValueError(f"token ids must lie in [0, 2^31), got [{int(arr.min())}, {int(arr.max())}]")
    return arr.astype(np.int32)


def _decode(blob: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """(lengths [D] int64, tokens [T] int32, version) of a `to_bytes` blob; ValueError if it is not one."""
    if len(blob) < _HEADER.size + 4 or blob[:4] != _MAGIC:
        raise ValueError("not a suffix history blob (bad magic or too short)")
    magic, fmt, _, docs, count, version = _HEADER.unpack_from(blob)
    if fmt != _FORMAT:
        raise ValueError(f"suffix history format {fmt} is not supported (this build reads {_FORMAT})")
    if zlib.crc32(blob[:-4]) != struct.unpack("<I", blob[-4:])[0]:
        raise ValueError("suffix history blob is corrupt (checksum mismatch)")
    want = 4 * (docs + count)
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(blob[_HEADER.size:-4], want + 1)
    except zlib.error as e:
        raise ValueError(f"suffix history blob is corrupt ({e})") from None
    if len(raw) != want or not inflater.eof or inflater.unused_data:
        raise ValueError("suffix history blob is corrupt (wrong payload size)")
    lengths = np.frombuffer(raw[: 4 * docs], "<u4").astype(np.int64)
    tokens = np.frombuffer(raw[4 * docs:], "<i4").astype(np.int32)
    if int(lengths.sum()) != count or (docs and int(lengths.min()) < 1) or (count and int(tokens.min()) < 0):
        raise ValueError("suffix history blob is inconsistent (document lengths or token ids)")
    return lengths, tokens, int(version)
