"""The model runner: owns the model's forward and the batch KV; the only code that runs the model
for the batching engine. One step = one forward over every running sequence's new tokens.

Each sequence contributes a `RowInput`: its new tokens (a draft tree, root first, or one token for
plain decoding), their depths (positions = the row's length + depth) and their additive float mask
among themselves ([w, w]: the tree's ancestor mask). The runner pads the rows to a common width,
builds one 4D mask [B, 1, W, L + W] (a row sees its own context [0, lens[b]) and its own tree; holes
and pads are hidden), runs the unmodified model's decoder once, and applies the LM head only to
the positions whose logits are needed. A prefill chunk is a single-row forward of the same kind.
On CUDA the batch step runs fixed-shape buckets instead, each captured once as a CUDA graph
(engine/model/static_step.py), and the LM head runs in float32 whatever the model's dtype.

Where the model fits it (engine/model/native.py), the whole forward is one C call over a packed
batch instead: the rows' tokens back to back without pads, each row with its own tree mask, KV row,
visible context and write column; the LM head runs on the needed positions only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


from .batch_kv import BatchKV
from .loader import resolve_batch_step
from .native import NativeForward, native_unsupported
from .static_step import StaticStep, spare_rows


def uses_kernel_pool(model) -> bool:
    """Whether `model`'s linear layers run on the compressed kernels (their own thread pool)."""
    from .kernels.qlinear import QLinear

    return any(isinstance(m, QLinear) for m in model.modules())


@contextmanager
def quiet_torch_threads(active: bool) -> Iterator[None]:
    """While a decode loop (or a calibration) whose linear layers run on the compressed kernels runs
    in this thread (`active`: `uses_kernel_pool`): torch's own intra-op threads set to 1. The
    kernels run on their own pool (csrc/pool.h), whose workers spin for a moment after each call;
    torch's OpenMP workers spin too after any parallel torch op (e.g. `triu`, an argmax over the
    vocabulary). Each set then spins on the cores the other needs: measured, a native width-2
    forward took 12 ms after one `torch.triu` instead of 7.9, and transformers' forward on the
    kernels 145 ms instead of ~17. torch's setting is per OS thread here; the previous value comes
    back at the end."""
    if not active:
        yield
        return
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@dataclass(frozen=True, repr=False)
class RowInput:
    """One running sequence's part of a batch step."""

    tokens: torch.Tensor  # [w] int64, root first
    depth: torch.Tensor  # [w] int64: position offset from the row's current length
    mask: torch.Tensor  # [w, w] additive float among the new tokens (0 visible, dtype-min hidden)

    def __repr__(self) -> str:
        return f"RowInput(w={self.tokens.shape[0]})"


def kv_dtype(native, dtype: torch.dtype) -> torch.dtype:
    """The KV buffers' dtype: float16 for the native forward in the int8 arithmetic (it writes values
    rounded to float16 and each key as a slot of int8 codes and scales in a float16 row's bytes:
    csrc/forward.c, csrc/ikeys.h), else the model's."""
    return torch.float16 if native is not None and native.arithmetic == "int8" else dtype


class ModelRunner:
    """The model, its device and the batch KV cache (rows = sequences)."""

    def __init__(self, model, max_rows: int, dtype: torch.dtype, native: bool | None = None, topk: int = 0,
                 batch_step: str = "auto") -> None:
        """native: the native forward (None: where the model supports it; True: required). topk: the
        native forward also returns each logits row's top-`topk` ids (`last_topk`), computed in C
        beside the LM head instead of by torch.topk/argmax afterwards. batch_step (transformers'
        forward only): "eager" pads the rows to the widest one (exact widths on CPUs, where pads cost
        compute); "static" runs fixed-shape buckets (engine/model/static_step.py); "graphs" the same
        with a CUDA graph per bucket; "auto" = graphs on CUDA, else eager."""
        self.model = model
        self.device = model.device
        self.dtype = dtype
        self._body = model.get_decoder()
        self._head = model.get_output_embeddings()
        # The split decoder + LM head is the model's own forward for these architectures; others
        # (e.g. logit soft-capping) compute full logits through the whole model.
        self._split = self._head is not None and not getattr(model.config, "final_logit_softcapping", None)
        self.hidden = torch.finfo(dtype).min
        why = native_unsupported(model) if native is not False else "not asked for"
        if native and why:
            raise ValueError(f"native forward unavailable: {why}")
        self.native = NativeForward(model) if why is None else None
        batch_step = resolve_batch_step(batch_step, self.device)
        if self.native is not None or not self._split:
            batch_step = "eager"  # the native forward packs rows itself; a full-logits model runs eagerly
        self.batch_step = batch_step
        # the native forward reads only columns it or an earlier step wrote: its KV needs no zeroing; it
        # applies sliding windows itself (rows keep every column), transformers' forward is refused them
        static = batch_step != "eager"
        self.kv = BatchKV(model.config, max_rows, kv_dtype(self.native, dtype), self.device,
                          zero_holes=self.native is None, spare_rows=spare_rows(max_rows) if static else 0,
                          windows_in_attention=self.native is not None)
        self.static = StaticStep(self._body, self.kv, dtype, self.device, graphs=batch_step == "graphs") if static \
            else None
        # logits in float32 whatever the model's dtype: bfloat16 logits tie too often for exact greedy
        self._head32 = _float32_head(self._head) if self._split and dtype != torch.float32 else None
        self._causal: dict[int, torch.Tensor] = {}
        self.topk = topk if self.native is not None else 0
        # the last forward's top-k ids: [m, topk] int32 per row for `step`, one tensor for `prefill` and
        # `single_step`; None where the forward did not compute them (consumers then use torch.topk)
        self.last_topk: list[torch.Tensor] | torch.Tensor | None = None
        # the last `step`'s confidences of those ids: [w_b, topk] uint8 per row, where it was asked for them
        # and the native forward computed them; else None (consumers then call top_probs)
        self.last_probs: list[torch.Tensor] | None = None
        self.step_s, self.steps = 0.0, 0  # time inside `step` (the batch forwards), for profiles

    @property
    def forward_kind(self) -> str:
        return "native" if self.native is not None else "transformers"

    def _logits(self, cache, input_ids, mask, positions, keep: torch.Tensor) -> torch.Tensor:
        """keep: [m] flat indices into [B * W] -> logits [m, V]."""
        if self._split:
            h = self._body(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).last_hidden_state  # [B, W, hidden]
            return self._head_logits(h.reshape(-1, h.shape[-1])[keep])
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits  # [B, W, V]
        return out.reshape(-1, out.shape[-1])[keep]

    def _head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [m, hidden] -> logits [m, V] (float32 where the model is not)."""
        if self._head32 is None:
            return self._head(h)
        weight, bias = self._head32
        return torch.nn.functional.linear(h.float(), weight, bias)

    def prefill(self, row: int, tokens: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
        """A chunk of a prompt into `row`: tokens [c] -> logits [m, V] at chunk offsets `need` [m]."""
        c = tokens.shape[0]
        logits = self._row_forward(row, tokens, torch.arange(c, device=self.device), None, need)
        self.kv.grow(row, c)
        return logits

    def single_step(self, row: int, r: RowInput) -> torch.Tensor:
        """A forward of `r` on KV row `row` alone -> logits [w, V]; the row keeps none of it (cost
        calibration: one sequence's step)."""
        return self._row_forward(row, r.tokens, r.depth, r.mask, None)

    def _row_forward(self, row: int, tokens: torch.Tensor, depth: torch.Tensor, mask: torch.Tensor | None,
                     need: torch.Tensor | None) -> torch.Tensor:
        """tokens [c] at positions len(row) + depth, written from column len(row); mask [c, c] additive
        among them (None: causal) -> logits [m, V] at `need` (None: all c)."""
        c = tokens.shape[0]
        start = self.kv.length(row)
        cache = self.kv.for_row(row, c)
        if self.native is not None:
            if mask is None:
                vis = self._causal.get(c)
                if vis is None:
                    vis = self._causal[c] = torch.ones(c, c, dtype=torch.uint8).tril()  # [c, c]
            else:
                vis = mask == 0
            r = self.kv.rows
            logits, self.last_topk, _ = self.native(r.k, r.v, [c], tokens, depth + start, [row], [start], [start],
                                                    vis, need, self.topk)
            return logits
        self.last_topk = None
        if c == 1:  # one token sees its whole row: transformers' own single-token path, no mask
            first = torch.zeros(1, dtype=torch.long, device=self.device)
            return self._logits(cache, tokens[None], None, (depth + start)[None], first)
        if mask is None:
            mask = torch.full((c, c), self.hidden, dtype=self.dtype, device=self.device).triu(1)  # [c, c]
        full = torch.cat([torch.zeros(c, start, dtype=self.dtype, device=self.device), mask], 1)[None, None]
        positions = (depth + start)[None]  # [1, c]
        keep = need if need is not None else torch.arange(c, device=self.device)
        return self._logits(cache, tokens[None], full, positions, keep)

    def step(self, rows: list[RowInput], probs: bool = False) -> list[torch.Tensor]:
        """One forward over the active rows (rows[b] is KV row b) -> per row logits [w_b, V]. probs: the
        native forward also computes the top-k ids' confidences (`last_probs`), in its pool."""
        assert len(rows) == self.kv.active, "a batch step takes every active row"
        t0 = time.perf_counter()
        self.last_probs = None
        try:
            return self._step(rows, probs)
        finally:
            self.step_s += time.perf_counter() - t0
            self.steps += 1

    def _step(self, rows: list[RowInput], probs: bool) -> list[torch.Tensor]:
        b = len(rows)
        widths = [r.tokens.shape[0] for r in rows]
        if self.native is not None:
            return self._native_step(rows, widths, probs)
        self.last_topk = None
        if self.static is not None:
            return list(torch.split(self._head_logits(self.static.forward(rows, widths)), widths))
        w = max(widths)
        cache = self.kv.for_batch(w)
        past = self.kv.rows.offset
        lens = torch.tensor(self.kv.rows.lens[:b], device=self.device)  # [B]
        ids = torch.zeros(b, w, dtype=torch.long, device=self.device)  # [B, W], pads = token 0
        depth = torch.zeros(b, w, dtype=torch.long, device=self.device)  # [B, W]
        mask = torch.full((b, 1, w, past + w), self.hidden, dtype=self.dtype, device=self.device)
        mask[:, 0, :, :past].masked_fill_((torch.arange(past, device=self.device) < lens[:, None])[:, None, :], 0.0)
        for i, r in enumerate(rows):
            n = widths[i]
            ids[i, :n], depth[i, :n] = r.tokens, r.depth
            mask[i, 0, :n, past : past + n] = r.mask
            mask[i, 0, n:, past + n :] = 0.0  # pads see only pads: no row is fully hidden
        positions = lens[:, None] + depth  # [B, W]
        if b == 1 and w == 1:  # one row, one token, no holes: transformers' own single-token path
            mask = None
        keep = torch.cat([torch.arange(n, device=self.device) + i * w for i, n in enumerate(widths)])
        logits = self._logits(cache, ids, mask, positions, keep)  # [sum w_b, V]
        return list(torch.split(logits, widths))

    def _native_step(self, rows: list[RowInput], widths: list[int], probs: bool) -> list[torch.Tensor]:
        b = len(rows)
        self.kv.for_batch(max(widths))
        r = self.kv.rows
        lens = r.lens[:b]
        ids = torch.cat([x.tokens for x in rows]) if b > 1 else rows[0].tokens  # [N]
        depth = torch.cat([x.depth for x in rows]) if b > 1 else rows[0].depth  # [N]
        pos = depth + torch.repeat_interleave(torch.tensor(lens), torch.tensor(widths)) if b > 1 else depth + lens[0]
        vis = torch.cat([(x.mask == 0).reshape(-1) for x in rows])  # the rows' [w_b, w_b] concatenated
        logits, top, q = self.native(r.k, r.v, widths, ids, pos, list(range(b)), lens, [r.offset] * b, vis, None,
                                     self.topk, probs)
        self.last_topk = list(torch.split(top, widths)) if top is not None else None
        self.last_probs = list(torch.split(q, widths)) if q is not None else None
        return list(torch.split(logits, widths))

    def keep(self, offsets: list[list[int]]) -> None:
        """After `step`: row b keeps its new entries at offsets[b] (root + accepted path)."""
        self.kv.keep(offsets)


def _float32_head(head) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A float32 copy of the LM head's weight and bias, made once per model (runners share it); None
    where the head is not a plain linear layer (it then runs as it is)."""
    if not isinstance(head, torch.nn.Linear):
        return None
    cached = getattr(head, "_trserve_float32", None)
    if cached is None:
        bias = head.bias.detach().float() if head.bias is not None else None
        cached = head._trserve_float32 = (head.weight.detach().float(), bias)
    return cached
