"""Fixed-shape batch forwards: the batch step a CUDA graph can replay.

A batch step's shapes change from step to step: the rows running, their widths, the context read.
Here each is rounded up to a bucket (rows Bb and width Wb to powers of two; the context read Cb to
a power of two of at least `min_context`, at most the batch KV's capacity), and everything that
varies inside a bucket is data in fixed buffers:

    ids   [Bb, Wb] int64        the rows' new tokens (root first), pads 0
    pos   [Bb, Wb] int64        len(row) + depth, pads 0
    mask  [Bb, 1, Wb, Cb]       additive: a row sees its own context [0, lens[b]) and its tree
    rows  [Bb, Wb] int64        the KV row each new key/value is written to
    cols  [Bb, Wb] int64        ... and its column: offset + j (offset = max lens, as BatchKV's batch forward)

The model's decoder (unmodified) runs on those buffers; the batch KV's layers write the new entries
with one indexed store and hand attention the first Bb rows x Cb columns (engine/model/batch_kv.py).

Pads are the positions of a row beyond its width and the rows beyond the batch (Bb > B). A pad
position sees only its own column and its hidden state is never read. Pad rows write into the
scratch row (the batch KV's last spare row, which no sequence holds): the first inactive row may be
a prompt being prefilled, and a pad row writing there would overwrite its entries.

Worked example: rows with lens [3, 5] and widths [2, 3] -> Bb 2, Wb 4, offset 5, Cb 256. Row 0's
tokens go to ids[0, :2] at positions 3 + depth and columns 5, 6; its mask row sees columns 0-2 and
its tree among columns 5, 6 (3, 4 are holes, hidden); ids[0, 2:] are pads, each seeing only its own
column (7, 8). Row 1's three tokens take columns 5-7, its pad column 8.

On CUDA each bucket is captured once as a CUDA graph (at its first step; at most `max_graphs` live,
the least recently used one dropped to make room for a new shape), and a step is: fill the buffers
(a few copies, no loop over tree nodes), replay, gather the needed positions' hidden states; the one
host round trip a step needs is the caller's accept decision on the logits. The graphs hold the KV buffers' addresses: when the batch KV grows
(doubling), they are dropped and recaptured. Without graphs (CPU, and the tests) the same buffers
feed an eager call: the same code path without the capture.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .batch_kv import BatchKV

log = logging.getLogger("trserve.engine")


def bucket(n: int) -> int:
    """n rounded up to a power of two (n >= 1)."""
    return 1 << (n - 1).bit_length()


def spare_rows(max_rows: int) -> int:
    """Buffer rows a static step needs beyond `max_rows`: up to the rows' bucket, plus the scratch row."""
    return bucket(max_rows) - max_rows + 1


@dataclass(eq=False)
class _Shape:
    """One bucket's input buffers, its output and (on CUDA) its captured graph."""

    ids: torch.Tensor  # [Bb, Wb] int64
    pos: torch.Tensor  # [Bb, Wb] int64
    mask: torch.Tensor  # [Bb, 1, Wb, Cb] additive float
    rows: torch.Tensor  # [Bb, Wb] int64
    cols: torch.Tensor  # [Bb, Wb] int64
    out: torch.Tensor | None = None  # [Bb, Wb, hidden]: the last forward's hidden states
    graph: object | None = None  # torch.cuda.CUDAGraph


class StaticStep:
    """Bucketed fixed-shape batch forwards of `body` (the model's decoder) over `kv` (see the module
    docstring). `kv` must hold `spare_rows(max_rows)` spare rows."""

    def __init__(self, body, kv: BatchKV, dtype: torch.dtype, device: torch.device, graphs: bool,
                 max_graphs: int = 64, min_context: int = 256) -> None:
        if kv.spare_rows < spare_rows(kv.rows.max_rows):
            raise ValueError(f"a static step needs {spare_rows(kv.rows.max_rows)} spare KV rows, got {kv.spare_rows}")
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        if graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.body, self.kv = body, kv
        self.dtype, self.device = dtype, device
        self.graphs, self.max_graphs, self.min_context = graphs, max_graphs, min_context
        self.scratch = kv.rows.max_rows + kv.spare_rows - 1  # the row pad rows write to
        self.hidden = torch.finfo(dtype).min
        self._shapes: OrderedDict[tuple[int, int, int], _Shape] = OrderedDict()  # least recently used first
        self._generation = -1  # the KV buffers' generation the shapes (and graphs) were made for
        self._pool = None  # the graphs' shared memory pool
        self.captured = 0  # live graphs

    def forward(self, rows: list, widths: list[int]) -> torch.Tensor:
        """rows: the active rows' RowInputs (rows[b] is KV row b) -> hidden states [N, hidden] of
        their tokens back to back (N = sum of widths)."""
        b = len(rows)
        bb, wb = bucket(b), bucket(max(widths))
        kv = self.kv
        kv.for_batch(wb)
        r = kv.rows
        if r.generation != self._generation:  # new buffers: every graph held the old addresses
            self._shapes.clear()
            self._generation, self._pool, self.captured = r.generation, None, 0
        cb = min(max(bucket(r.offset + wb), self.min_context), r.capacity)
        shape = self._shapes.get((bb, wb, cb))
        if shape is None:
            shape = self._shapes[(bb, wb, cb)] = self._new(bb, wb, cb)
        self._shapes.move_to_end((bb, wb, cb))
        flat = self._fill(shape, rows, widths, r.lens[:b], r.offset)
        r.scatter = (shape.rows, shape.cols, bb, cb)
        try:
            if shape.graph is None and self.graphs:
                self._make_room()
                self._capture(shape)
            if shape.graph is not None:
                shape.graph.replay()
            else:
                shape.out = self._run(shape)
        finally:
            r.scatter = None
        return shape.out.reshape(bb * wb, -1)[flat]

    def _new(self, bb: int, wb: int, cb: int) -> _Shape:
        dev = self.device
        z = torch.zeros(bb, wb, dtype=torch.long, device=dev)
        return _Shape(z, z.clone(), torch.empty(bb, 1, wb, cb, dtype=self.dtype, device=dev), z.clone(), z.clone())

    def _fill(self, shape: _Shape, rows: list, widths: list[int], lens: list[int], offset: int) -> torch.Tensor:
        """The step's data into `shape`'s buffers -> flat indices [N] of the rows' tokens in [Bb * Wb]."""
        dev = self.device
        bb, wb = shape.ids.shape
        cb = shape.mask.shape[-1]
        b = len(rows)
        w = torch.tensor(widths)  # [B] (host)
        row_of = torch.repeat_interleave(torch.arange(b), w)  # [N]
        j = torch.arange(row_of.shape[0]) - (torch.cumsum(w, 0) - w)[row_of]  # [N] offset within its row
        flat = (row_of * wb + j).to(dev)  # [N]
        tokens = torch.cat([x.tokens for x in rows]) if b > 1 else rows[0].tokens  # [N]
        depth = torch.cat([x.depth for x in rows]) if b > 1 else rows[0].depth  # [N]
        lens_b = torch.tensor(list(lens) + [0] * (bb - b), device=dev)  # [Bb]
        shape.ids.zero_()
        shape.ids.view(-1).index_copy_(0, flat, tokens)
        shape.pos.zero_()
        shape.pos.view(-1).index_copy_(0, flat, depth + lens_b[flat // wb])
        # the new tokens' block among themselves [Bb, Wb, Wb]: each row's tree mask; pads see themselves
        sq = w * w
        rs = torch.repeat_interleave(torch.arange(b), sq)  # [S] the row of each tree-mask entry
        e = torch.arange(rs.shape[0]) - (torch.cumsum(sq, 0) - sq)[rs]  # [S] entry within its row's [w, w]
        at = (rs * wb * wb + (e // w[rs]) * wb + e % w[rs]).to(dev)  # [S]
        block = torch.zeros(bb * wb * wb, dtype=torch.bool, device=dev)
        block[at] = torch.cat([(x.mask == 0).reshape(-1) for x in rows])
        padded = torch.tensor(widths + [0] * (bb - b), device=dev)  # [Bb]
        pads = torch.arange(wb, device=dev)[None, :] >= padded[:, None]  # [Bb, Wb]
        block = block.view(bb, wb, wb) | torch.diag_embed(pads)
        vis = (torch.arange(cb, device=dev)[None, :] < lens_b[:, None])[:, None, :].expand(bb, wb, cb).clone()
        vis[:, :, offset : offset + wb] = block  # [Bb, Wb, Cb]
        shape.mask.fill_(self.hidden)
        shape.mask[:, 0].masked_fill_(vis, 0.0)
        row = torch.arange(bb, device=dev)
        shape.rows.copy_(torch.where(row < b, row, self.scratch)[:, None].expand(bb, wb))
        shape.cols.copy_((offset + torch.arange(wb, device=dev))[None, :].expand(bb, wb))
        return flat

    def _make_room(self) -> None:
        """At `max_graphs` live graphs: drop the least recently used shapes (buffers and graph)."""
        for key in list(self._shapes):
            if self.captured < self.max_graphs:
                return
            if self._shapes[key].graph is not None:
                del self._shapes[key]
                self.captured -= 1

    def _run(self, shape: _Shape) -> torch.Tensor:
        return self.body(input_ids=shape.ids, attention_mask=shape.mask, position_ids=shape.pos,
                         past_key_values=self.kv.cache, use_cache=True).last_hidden_state  # [Bb, Wb, hidden]

    def _capture(self, shape: _Shape) -> None:
        """Warm up on a side stream, then capture `shape.graph`. Where the capture fails (a model whose
        forward syncs with the host, say), this step and every later one run eagerly, with a warning,
        rather than failing."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # writes this step's own entries; the capture below writes the same
                self._run(shape)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._run(shape)
        except RuntimeError as e:
            log.warning("CUDA graph capture failed (%s); batch steps run eagerly from now on", e)
            self.graphs = False
            return
        shape.out = out
        self._pool = graph.pool()
        shape.graph = graph
        self.captured += 1
        log.info("captured a CUDA graph for %d rows x %d tokens over %d columns (%d live)",
                 *shape.ids.shape, shape.mask.shape[-1], self.captured)
