"""The KV cache of a batch: one row per running sequence, each row with its own length.

Layout per layer: keys/values buffers [R, Hkv, capacity, D] (R = max rows). Rows 0..B-1 are the
running sequences; row b holds its context contiguously in [0, lens[b]). A batch forward writes
every row's new tokens at the common offset L = max(lens) (a row shorter than L has masked holes
in [lens[b], L), never read); `keep` then moves each row's accepted entries down to
[lens[b], lens[b] + a_b). A single-row forward (a prefill chunk) writes row s at lens[s] and sees
only that row. transformers sees an ordinary Cache whose layers return the rows of this forward.

Worked example, two rows, lens [3, 5], a step of width 2 per row: the step writes columns 5, 6 of
both rows; row 0 accepts offsets [0, 1] -> columns 5, 6 move to 3, 4 (lens 5); row 1 accepts [0]
-> column 5 stays (lens 6); the next step writes at L = 6 and masks row 0's column 5.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ...core.errors import InvalidArgument


class _Rows:
    """Buffers and bookkeeping shared by the layers of one BatchKV."""

    def __init__(self, rows: int) -> None:
        self.max_rows = rows
        self.lens = [0] * rows  # valid context per row
        self.active = 0  # rows 0..active-1 run in batch forwards
        self.single: int | None = None  # the row of a single-row forward, else None (batch)
        self.offset = 0  # batch forward: where this step's entries go (= max lens of the active rows)
        self.k: list[torch.Tensor | None] = []  # per layer [R, Hkv, capacity, D]: views of `buf`
        self.v: list[torch.Tensor | None] = []
        self.buf: torch.Tensor | None = None  # [2, layers, R + spare, Hkv, capacity, D]: every layer's keys, values
        self.capacity = 0
        self.generation = 0  # bumped whenever `buf` is reallocated (captured CUDA graphs hold its addresses)
        # a fixed-shape batch forward (engine/model/static_step.py): (rows [Bb, Wb], columns [Bb, Wb]) where
        # each new entry is written, and how many rows and columns of the buffers it reads; None otherwise
        self.scatter: tuple[torch.Tensor, torch.Tensor, int, int] | None = None


class RowLayer(DynamicLayer):
    def __init__(self, rows: _Rows, index: int) -> None:
        super().__init__()
        self.rows, self.index = rows, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states: [b, Hkv, n, D] of this forward's rows -> all their keys [b, Hkv, end, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        r, i = self.rows, self.index
        k, v = r.k[i], r.v[i]
        n = key_states.shape[-2]
        if r.scatter is not None:  # fixed shapes: [Bb, Hkv, Wb, D] written at (rows, columns), Cb columns read
            rows, cols, bb, cb = r.scatter
            k[rows, :, cols] = key_states.transpose(1, 2)  # [Bb, Wb, Hkv, D]
            v[rows, :, cols] = value_states.transpose(1, 2)
            self.keys, self.values = k[:bb, :, :cb], v[:bb, :, :cb]
        elif r.single is not None:
            s, start = r.single, r.lens[r.single]
            k[s, :, start : start + n] = key_states[0]
            v[s, :, start : start + n] = value_states[0]
            self.keys, self.values = k[s : s + 1, :, : start + n], v[s : s + 1, :, : start + n]
        else:
            b, start = r.active, r.offset
            k[:b, :, start : start + n] = key_states
            v[:b, :, start : start + n] = value_states
            self.keys, self.values = k[:b, :, : start + n], v[:b, :, : start + n]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        r = self.rows
        return r.lens[r.single] if r.single is not None else r.offset


class BatchKV:
    """Rows of KV for up to `max_rows` sequences (see the module docstring)."""

    def __init__(self, model_config, max_rows: int, dtype: torch.dtype, device: torch.device,
                 zero_holes: bool = True, spare_rows: int = 0, windows_in_attention: bool = False) -> None:
        """zero_holes False: the forwards never read a column no forward wrote (the native one: each
        row's context and its step's own new columns), so grown buffers are not zero-filled.
        spare_rows: buffer rows beyond `max_rows` that no sequence gets (the pad rows and the scratch
        row of fixed-shape batch forwards). windows_in_attention: the forward applies sliding windows
        itself, by position, over rows that keep every column (the native forward: csrc/forward.c),
        so a model whose transformers cache would use sliding-window layers is taken. transformers'
        forward is not: the runner hands it a 4D mask of its own (rows, holes, trees), which
        transformers uses as it is, with no window in it, and its sliding cache layers
        (DynamicSlidingWindowLayer) keep only a row's last window of keys, which rows of unequal
        lengths and a tree's dropped branches do not fit; there such a model is refused."""
        self.zero_holes = zero_holes
        self.spare_rows = spare_rows
        self.cache = DynamicCache(config=model_config)
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if windows_in_attention:
            kinds -= {"DynamicSlidingWindowLayer"}  # every layer becomes a RowLayer below: all columns kept
        if kinds:
            raise InvalidArgument(f"tree decoding needs full-attention KV layers; this model uses {sorted(kinds)}")
        text = model_config.get_text_config(decoder=True)
        self.heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        self.dtype, self.device = dtype, device
        self.rows = _Rows(max_rows)
        self.rows.k = [None] * len(self.cache.layers)
        self.rows.v = [None] * len(self.cache.layers)
        self.cache.layers = [RowLayer(self.rows, i) for i in range(len(self.cache.layers))]

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def active(self) -> int:
        return self.rows.active

    def length(self, row: int) -> int:
        return self.rows.lens[row]

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` columns per row (doubling; copies only the rows' valid entries)."""
        r = self.rows
        if tokens <= r.capacity:
            return
        cap = max(tokens, 2 * r.capacity, 256)
        # zeros where a forward reads masked holes (transformers' attention multiplies them by the
        # queries, and stale memory can hold inf/NaN, which a -inf-like additive mask does not cancel:
        # NaN logits). Without holes read, empty: zero-filling every row to the new capacity (~0.8 MB
        # per column at 17 rows on the bundled model) stalled the batch for seconds when a 2,000-token
        # prompt doubled it. One buffer for all layers, so that moving a row's entries is one indexing op.
        new = torch.zeros if self.zero_holes else torch.empty
        buf = new(2, len(r.k), r.max_rows + self.spare_rows, self.heads, cap, self.head_dim, dtype=self.dtype,
                  device=self.device)
        if r.buf is not None:
            for row, used in enumerate(r.lens):  # each open row's valid entries (closed rows hold none)
                if used:
                    buf[:, :, row, :, :used, :] = r.buf[:, :, row, :, :used, :]
        r.buf = buf
        r.k, r.v = list(buf[0].unbind(0)), list(buf[1].unbind(0))  # contiguous [R, Hkv, cap, D] each
        r.capacity = cap
        r.generation += 1

    # ---- forwards -------------------------------------------------------------------------------
    def for_row(self, row: int, tokens: int) -> DynamicCache:
        """The cache for a single-row forward of `tokens` new entries (a prefill chunk of that row)."""
        self.reserve(self.rows.lens[row] + tokens)
        self.rows.single = row
        return self.cache

    def for_batch(self, width: int) -> DynamicCache:
        """The cache for a forward of every active row, `width` new entries each, at max(lens)."""
        r = self.rows
        r.single = None
        r.offset = max(r.lens[: r.active], default=0)
        self.reserve(r.offset + width)
        return self.cache

    def grow(self, row: int, n: int) -> None:
        """A single-row forward's n entries are now the row's context (a prefill chunk)."""
        self.rows.lens[row] += n

    def keep(self, keep: list[list[int]]) -> None:
        """After a batch forward: row b keeps the entries at offsets keep[b] (ascending) of the step,
        moved to [lens[b], lens[b] + len(keep[b]))."""
        r = self.rows
        assert len(keep) == r.active, "one keep list per active row"
        moves = []  # (row, from column, to column)
        for b, offsets in enumerate(keep):
            start = r.lens[b]
            for j, off in enumerate(offsets):
                if r.offset + off != start + j:
                    moves.append((b, r.offset + off, start + j))
            r.lens[b] = start + len(offsets)
        # One strided copy per entry (a step keeps 1 + accepted per row): 4x faster than one
        # advanced-indexing gather/scatter (measured 155 vs 615 us for 11 entries). In order, a row's
        # destination column is always below its later sources (offsets ascend, sources sit at offset >= lens).
        for b, src, dst in moves:
            r.buf[:, :, b, :, dst].copy_(r.buf[:, :, b, :, src])

    # ---- rows -----------------------------------------------------------------------------------
    def open_row(self, row: int | None = None) -> int:
        """The row a new sequence prefills into (`row`, an inactive one; default the first), emptied."""
        r = self.rows
        row = r.active if row is None else row
        if not r.active <= row < r.max_rows:
            raise RuntimeError(f"no free KV row {row} (active {r.active}, rows {r.max_rows})")
        r.lens[row] = 0
        return row

    def activate(self, row: int) -> None:
        """The prefilled `row` (== active) joins the batch forwards."""
        assert row == self.rows.active, "rows join in order"
        self.rows.active += 1

    def close_row(self, row: int) -> int | None:
        """Drop active `row`; the last active row moves into its place. Returns the moved row's old
        index (the caller renumbers that sequence), or None."""
        r = self.rows
        last = r.active - 1
        moved = None
        if row != last:
            n = r.lens[last]
            if r.buf is not None:
                r.buf[:, :, row, :, :n] = r.buf[:, :, last, :, :n]
            r.lens[row] = n
            moved = last
        r.lens[last] = 0
        r.active -= 1
        return moved

    def row_view(self, row: int) -> torch.Tensor:
        """`row`'s entries in place: [2, layers, Hkv, capacity, D] (its first length(row) columns valid)."""
        assert self.rows.buf is not None
        return self.rows.buf[:, :, row]

    def load_prefix(self, row: int, blocks: tuple[torch.Tensor, ...], n: int) -> None:
        """The first n columns of `blocks` ([2, layers, Hkv, B, D] each, columns in order:
        engine/prefix_cache.py) become empty `row`'s context."""
        r = self.rows
        assert r.lens[row] == 0, "a prefix goes into an empty row"
        self.reserve(n)
        dst, width = r.buf[:, :, row], blocks[0].shape[3]  # [2, layers, Hkv, capacity, D]
        for i, block in enumerate(blocks[: -(-n // width)]):
            s, e = i * width, min(n, (i + 1) * width)
            dst[:, :, :, s:e].copy_(block[:, :, :, : e - s])
        r.lens[row] = n

    def move_row(self, src: int, dst: int) -> None:
        """Copy an inactive row's entries (a prefill in progress) to another inactive row."""
        r = self.rows
        n = r.lens[src]
        if r.buf is not None:
            r.buf[:, :, dst, :, :n] = r.buf[:, :, src, :, :n]
        r.lens[dst], r.lens[src] = n, 0

    def swap_rows(self, a: int, b: int) -> None:
        """Exchange two inactive rows' entries (prefills in progress)."""
        r = self.rows
        assert a >= r.active and b >= r.active, "only inactive rows are swapped"
        na, nb = r.lens[a], r.lens[b]
        if r.buf is not None:
            held = r.buf[:, :, a, :, :na].clone()
            r.buf[:, :, a, :, :nb] = r.buf[:, :, b, :, :nb]
            r.buf[:, :, b, :, :na] = held
        r.lens[a], r.lens[b] = nb, na

    def reset(self) -> None:
        """Every row empty and inactive (the buffers are kept)."""
        r = self.rows
        r.lens, r.active, r.single, r.offset = [0] * r.max_rows, 0, None, 0

    def __repr__(self) -> str:
        r = self.rows
        return f"BatchKV(active={r.active}/{r.max_rows}, lens={r.lens[: r.active]}, capacity={r.capacity})"
