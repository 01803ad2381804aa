"""The `QLinear` torch module (an `nn.Linear` on the exact compressed kernels) and
`quantize_linears`, which swaps it in for every linear layer whose weights recover exactly."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .build import ARITHMETICS, _library, kernel_isa, q4_layout
from .kquants import IMPLIED
from .pack import PANEL, pack_q4, pack_q4_i8, pack_q5, pack_q5_i8, pack_q6, pack_q8, pack_q8_i8, pack_scales
from .recover import recover_q4, recover_q8

# kinds (csrc/qlinear.h): codes' bits, the scales' form ("f16", "f32" values, or "two": a GGUF file's
# two-level records, kquants.py), scales per block of 32, a min per block
KINDS = {4: (4, "f16", 1, True), 8: (8, "f16", 1, False), 6: (4, "two", 1, True), 10: (8, "two", 1, True),
         18: (8, "two", 2, False), 9: (8, "f32", 1, True), 5: (4, "f32", 1, True), 17: (8, "f32", 2, False),
         12: (5, "f16", 1, True), 20: (8, "two", 2, False), 22: (8, "two", 1, True)}  # 20, 22: taken as kinds 18's and
# 10's 8-bit codes, held as 6- and 5-bit ones

log = logging.getLogger("trserve.engine")


def _scale_shapes(kind: int, in_features: int, out_features: int) -> tuple[tuple, tuple]:
    """The shapes QLinear takes a kind's scales and mins in."""
    _, form, per, _ = KINDS[kind]
    nb = in_features // 32
    if form == "two":  # per row and super-block of 256: a float16's 2 bytes, then a byte per sub-block
        return (out_features, nb // 8, 2 + 8 * per), (out_features, nb // 8, 10)
    return (out_features, nb * per), (out_features, nb)


def _records(v: torch.Tensor) -> torch.Tensor:
    if v.dtype != torch.uint8:
        raise ValueError("two-level scales are byte records (kquants.decode)")
    return v.contiguous()


def _half(v: torch.Tensor) -> torch.Tensor:
    """v: float32 scales that are float16 values -> the same values as float16 (exact, checked)."""
    h = v.to(torch.float16)
    if not torch.equal(h.to(torch.float32), v):
        raise ValueError("block scales must be float16 values (as recover_q4 / recover_q8 return them)")
    return h.contiguous()


class QLinear(nn.Module):
    """`nn.Linear` replacement over exactly recovered 4-bit (kind 4) or 8-bit (kind 8) blocks, or a GGUF
    file's blocks (engine/model/kernels/kquants.py): the K-quants' two-level scales (kinds 6, 10, 18; Q6_K held as
    6-bit codes: kind 20), Q5_0's and Q5_1's 5-bit codes (kind 12), 8-bit codes with float32 scales and mins (kind 9), or the
    K-quants' float32 products (kinds 5, 17: the reference kinds).

    codes: [O, I/2] (4-bit kinds) or [O, I] (8-bit) uint8 as recover_q4 / recover_q8 give them, or kind
    12's [O, I/32 * 20] (per block ggml's qh and qs bytes: pack.py's q5_values); d, m:
    [O, I/32] float32 (float16 values for kinds 4, 8 and 12; kind 17: d [O, I/16]; m None where the kind has
    no min, or for kinds 4 and 12 where it is -8 d or -16 d: a file's Q4_0 and Q5_0, kquants.implied_min), or the two-level kinds' records [O, I/256, 10] uint8 (kind 18: d [O, I/256, 18]; I % 256 ==
    0). Held in the kernels' panel layout (`pack_q4` / `pack_q8`), scales as float16, float32 or records
    as the kind says; isa: the kernel variant ("auto": this CPU's best);
    arithmetic: "exact" (float32 fma chains over the rebuilt weights, csrc/qlinear.c) or "int8"
    (activations quantized per block of 32, integer dot products, csrc/qlinear_i8.c; its own code
    layout, `pack_q4_i8` / `pack_q8_i8`)."""

    def __init__(self, kind: int, codes, d, m, bias, in_features: int, out_features: int, cache_dir: Path,
                 isa: str = "auto", arithmetic: str = "exact") -> None:
        super().__init__()
        if arithmetic not in ARITHMETICS:
            raise ValueError(f"arithmetic must be one of {', '.join(ARITHMETICS)}; got {arithmetic!r}")
        if kind not in KINDS or out_features < 1 or in_features % (256 if KINDS[kind][1] == "two" else 32):
            raise ValueError(f"QLinear takes blocks of 32 (two-level kinds: 256) of kinds {sorted(KINDS)} and at "
                             f"least one output; got kind {kind} {in_features} -> {out_features}")
        bits, form, _, has_min = KINDS[kind]
        d_shape, m_shape = _scale_shapes(kind, in_features, out_features)
        implied = m is None and kind in IMPLIED  # Q4_0 / Q5_0: the min -8 d / -16 d formed by the kernels
        if codes.shape != (out_features, in_features * bits // 8) or d.shape != d_shape or \
                (has_min and not implied and (m is None or m.shape != m_shape)):
            raise ValueError(f"codes {tuple(codes.shape)} / scales {tuple(d.shape)} do not match kind {kind} "
                             f"{in_features} -> {out_features}")
        self.kind, self.in_features, self.out_features = kind, in_features, out_features
        self.isa, self.arithmetic = kernel_isa(isa), arithmetic
        scale = {"f16": _half, "two": _records}.get(form, lambda v: v.to(torch.float32).contiguous())
        d, m = scale(d), scale(m) if has_min and not implied else None
        if kind == 20:  # Q6_K's 6-bit codes: nibbles and two bit planes in the build's layouts
            codes, d, m = pack_q6(codes, d, q4_layout(cache_dir, self.isa), arithmetic == "int8")
        elif kind == 22:  # Q5_K's 5-bit codes: kind 12's nibbles and plane, kind 10's records
            codes, d, m = (pack_q5_i8 if arithmetic == "int8" else pack_q5)(codes, d, m, q4_layout(cache_dir, self.isa),
                                                                           values=True)
        elif bits == 4 and arithmetic == "int8":
            codes, d, m = pack_q4_i8(codes, d, m)
        elif bits == 5 and arithmetic == "int8":  # its plane in the layout of the build's q4 layout's builds
            codes, d, m = pack_q5_i8(codes, d, m, q4_layout(cache_dir, self.isa))
        elif bits in (4, 5):
            codes, d, m = (pack_q4 if bits == 4 else pack_q5)(codes, d, m, q4_layout(cache_dir, self.isa))
        else:
            codes, d = (pack_q8_i8 if arithmetic == "int8" else pack_q8)(codes, d)
            m = pack_scales(m, -(-out_features // PANEL)) if m is not None else None
        self.register_buffer("codes", codes, persistent=False)  # [P, nb, 256, 320 or 512 bytes] uint8
        # [P, nb (2 nb for kind 17), 16] float16 or float32; two-level kinds: [P, I/256, 160 or 288] uint8
        self.register_buffer("d", d, persistent=False)
        self.register_buffer("m", m if m is not None else torch.zeros(0, dtype=torch.float16), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self._fn = _library(cache_dir, self.isa, arithmetic)
        self.threads: int | None = None  # the kernels' threads (csrc/pool.h); None: torch.get_num_threads()
        # int8: inputs kept in float32 (engine/model/kernels/outliers.py): their dims [k] and W[:, dims] [k, O]
        self.register_buffer("kept", torch.zeros(0, dtype=torch.int32), persistent=False)
        self.register_buffer("kept_w", torch.zeros(0, out_features), persistent=False)

    def keep_inputs(self, dims: torch.Tensor, weights: torch.Tensor) -> None:
        """int8 arithmetic: keep inputs `dims` [k] (k <= 16) in float32, with W[:, dims] as `weights` [k, O]."""
        if self.arithmetic != "int8":
            raise ValueError("kept inputs are part of the int8 arithmetic")
        if dims.dim() != 1 or not 0 <= dims.numel() <= 16 or weights.shape != (dims.numel(), self.out_features) or \
                (dims.numel() and not 0 <= int(dims.min()) <= int(dims.max()) < self.in_features):
            raise ValueError(f"kept inputs: at most 16 dims in [0, {self.in_features}) and weights [k, {self.out_features}]")
        self.kept = dims.to(torch.int32).contiguous()
        self.kept_w = weights.to(torch.float32).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()  # [n, I]
        if x2.dtype != torch.float32:
            raise TypeError(f"QLinear takes float32 input, got {x2.dtype}")
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)  # [n, O]
        bias = self.bias.data_ptr() if self.bias is not None else None
        m = self.m.data_ptr() if self.m.numel() else None
        args = (self.kind, x2.data_ptr(), x2.shape[0], self.in_features, self.out_features, self.codes.data_ptr(),
                self.d.data_ptr(), m, bias)
        if self.arithmetic == "int8":
            args += (self.kept.data_ptr() if self.kept.numel() else None, self.kept.numel(),
                     self.kept_w.data_ptr() if self.kept.numel() else None)
        rc = self._fn(*args, y.data_ptr(), self.threads or torch.get_num_threads())
        if rc == -3:
            raise ValueError(f"this build of the compressed kernels does not know kind {self.kind}")
        if rc:
            raise MemoryError("compressed kernel: no memory for its buffers")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kept = f", {self.kept.numel()} inputs kept" if self.kept.numel() else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind {self.kind} blocks, "
                f"{self.isa}, {self.arithmetic}{kept}")


def set_threads(model: nn.Module, threads: int) -> str | None:
    """Every QLinear of `model` on `threads` kernel threads; returns their arithmetic (None: there are none)."""
    arithmetic = None
    for module in model.modules():
        if isinstance(module, QLinear):
            module.threads, arithmetic = threads, module.arithmetic
    return arithmetic


def quantize_linears(model: nn.Module, cache_dir: Path, isa: str = "auto", arithmetic: str = "exact",
                     kept_inputs: dict[str, list[int]] | None = None, blocks: dict | None = None) -> tuple[int, int]:
    """Swap every nn.Linear whose weight recovers exactly, or that a GGUF file's K-quant `blocks` rebuild
    (module name -> kquants.Blocks, checked by gguf_file.file_blocks), for a QLinear on kernel variant
    `isa` ("auto": this CPU's best; others for tests and measurements) in `arithmetic` (int8: with the
    layers' `kept_inputs`, engine/model/kernels/outliers.py); returns (swapped, kept)."""
    isa = kernel_isa(isa)
    swapped = kept = 0
    cols = _kept_columns(model, kept_inputs) if kept_inputs and arithmetic == "int8" else {}
    names = {id(m): n for n, m in model.named_modules()}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            w = child.weight.detach()
            bias = child.bias.detach().contiguous() if child.bias is not None else None
            found = (blocks or {}).get(names.get(id(child)))
            q4 = recover_q4(w) if found is None else None
            if found is not None:
                kind, codes, d, m = found
                new = QLinear(kind, torch.from_numpy(codes), torch.from_numpy(d),
                              None if m is None else torch.from_numpy(m), bias, child.in_features,
                              child.out_features, cache_dir, isa, arithmetic)
            elif q4 is not None:
                new = QLinear(4, *q4, bias, child.in_features, child.out_features, cache_dir, isa, arithmetic)
            else:
                q8 = recover_q8(w)
                if q8 is None:
                    kept += 1
                    continue
                new = QLinear(8, q8[0].view(torch.uint8), q8[1], None, bias, child.in_features, child.out_features,
                              cache_dir, isa, arithmetic)
            if names.get(id(child)) in cols:
                new.keep_inputs(*cols[names[id(child)]])
            setattr(module, name, new)
            swapped += 1
    log.info("compressed kernels (%s, %s): %d linear layers swapped, %d kept", isa, arithmetic, swapped, kept)
    return swapped, kept


def _kept_columns(model: nn.Module, kept: dict[str, list[int]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per linear layer with kept inputs: (dims [k] int32, W[:, dims] as [k, out] float32), taken from its
    float32 weights before they are swapped for compressed kernels."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and kept.get(name):
            dims = torch.tensor(kept[name], dtype=torch.int32)
            out[name] = (dims, module.weight.detach()[:, dims.long()].t().contiguous().float())
    return out

