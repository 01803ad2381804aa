"""The kernels' panel layouts (csrc/qlinear.c's and csrc/qlinear_i8.c's top comments): recovered codes
and their scales rearranged so one load gives 16 outputs' weights (pure tensor functions). Scales are
[O, nb] (nb per block or half-block) values of any dtype, or a two-level kind's records [O, I/256, 2 + k]
uint8 (kquants.py): `pack_scales` takes either."""

from __future__ import annotations

import torch

PANEL = 16  # outputs per panel of the packed layout (csrc/qlinear.h)
Q4_LAYOUTS = ("bytes", "lanes")  # the q4 code layouts, by the number trserve_qlinear_q4_layout returns


def _pad_outputs(t: torch.Tensor, panels: int) -> torch.Tensor:
    """t: [O, ...] -> [panels * PANEL, ...], the added outputs zero (their weights rebuild to 0)."""
    pad = panels * PANEL - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, layout: str = "bytes"):
    """recover_q4's (codes [O, I/2], d, m [O, I/32]) -> the panel layout of csrc/qlinear.c:
    codes [P, nb, 16, 16] uint8, either "bytes" (byte [p, b, j, l] = q[16p + l, 32b + 2j] |
    q[.., 32b + 2j + 1] << 4) or "lanes" (the 256 bytes of panel-block [p, b] are 4 x 16 little-endian
    uint32, word [g, l] = sum_k q[16p + l, 32b + 8g + k] << 4k); d, m [P, nb, 16] (P = ceil(O / 16)
    panels, padded outputs zero), or two-level records [O, I/256, 10] as pack_scales packs them."""
    if layout not in Q4_LAYOUTS:
        raise ValueError(f"q4 layout must be one of {Q4_LAYOUTS}, got {layout!r}")
    O, nb = codes.shape[0], codes.shape[1] // 16
    P = -(-O // PANEL)
    blk = codes.reshape(O, nb, 16)
    q = torch.cat([blk & 0xF, blk >> 4], dim=-1)  # [O, nb, 32]: input 32b + i
    q = _pad_outputs(q, P).reshape(P, PANEL, nb, 32)  # [P, l, nb, i]
    if layout == "bytes":
        q = q.reshape(P, PANEL, nb, 16, 2)  # [P, l, nb, j, input 2j + k]
        packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1)  # [P, nb, j, l]
    else:
        q = q.reshape(P, PANEL, nb, 4, 4, 2)  # word g's byte c: nibbles k = 2c, 2c + 1 (bits 4k .. 4k + 3)
        packed = (q[..., 0] | (q[..., 1] << 4)).permute(0, 2, 3, 1, 4).reshape(P, nb, 16, 16)  # words [P, nb, g, l]
    return packed.contiguous(), pack_scales(d, P), pack_scales(m, P)


def _q4_values(codes: torch.Tensor, O: int, nb: int, P: int) -> torch.Tensor:
    """recover_q4's codes [O, I/2] -> the 4-bit values [P, PANEL, nb, 32] (input 32b + i; padded outputs 0)."""
    blk = codes.reshape(O, nb, 16)
    return _pad_outputs(torch.cat([blk & 0xF, blk >> 4], dim=-1), P).reshape(P, PANEL, nb, 32)


def pack_q4_i8(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
    """recover_q4's (codes [O, I/2], d, m [O, I/32]) -> the int8 arithmetic's layout (csrc/qlinear_i8.c):
    codes [P, nb, 4, 64] uint8, chunk h byte [4l + k] = q[16p + l, 32b + 8h + k] |
    q[16p + l, 32b + 8h + 4 + k] << 4; d, m [P, nb, 16] as pack_q4.

    Worked example, one output (l = 0) whose block holds q = 0, 1, ..., 15, 0, 1, ..., 15: chunk 0's
    bytes 0..3 are 0x40, 0x51, 0x62, 0x73 (inputs 0..3 low, 4..7 high)."""
    O, nb = codes.shape[0], codes.shape[1] // 16
    P = -(-O // PANEL)
    q = _q4_values(codes, O, nb, P).reshape(P, PANEL, nb, 4, 2, 4)  # [P, l, nb, h, half, k]
    packed = (q[:, :, :, :, 0] | (q[:, :, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, nb, h, l, k]
    return packed.reshape(P, nb, 4, 64).contiguous(), pack_scales(d, P), pack_scales(m, P)


def pack_q8_i8(codes: torch.Tensor, d: torch.Tensor):
    """recover_q8's (codes [O, I] int8, or its uint8 view; d [O, I/32], or [O, I/16] for a scale per 16
    inputs) -> the int8 arithmetic's layout: codes [P, nb, 8, 64] uint8, group g byte [4l + k] =
    q[16p + l, 32b + 4g + k] + 128; d [P, nb, 16] ([P, 2 nb, 16])."""
    O, nb = codes.shape[0], codes.shape[1] // 32
    P = -(-O // PANEL)
    q = _pad_outputs(codes.view(torch.uint8).reshape(O, nb, 32), P)  # padded outputs: q = 0
    packed = q.reshape(P, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()  # [P, nb, g, l, k]
    packed ^= 0x80  # q + 128 as a byte, in the one copy made (a head's codes are 100 MB)
    return packed.reshape(P, nb, 8, 64), pack_scales(d, P)


def _le_bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 words [..., n] holding 32-bit values -> their little-endian bytes [..., 4 n] uint8."""
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8).flatten(-2)


# ---- 5-bit codes (kind 12): GGUF's Q5_0 / Q5_1 blocks without their scales ----------------------------
# The planes are formed a byte at a time in uint8 (sums of distinct bits): wider integers took 1.6 GB for
# a moment packing a 7B's 11008 x 4096 layer.
Q5_BLOCK = 20  # bytes per row and block of 32: qh (4), then qs (16)
_BITS = torch.arange(8, dtype=torch.uint8)  # a byte's bit positions


def q5_values(codes: torch.Tensor) -> torch.Tensor:
    """Kind 12's codes [O, I/32 * 20] uint8 -> the 5-bit values [O, nb, 32] uint8 (0..31). Per row and
    block, ggml's own Q5_0/Q5_1 code bytes: qh, a little-endian uint32 whose bit j is q_j >> 4, then qs,
    16 bytes, byte j = (q_j & 15) | (q_{j+16} & 15) << 4 (recover_q4's nibble packing)."""
    blk = codes.reshape(codes.shape[0], -1, Q5_BLOCK)  # uint8 throughout: a 7B's layer is 45M codes
    high = ((blk[..., :4, None] >> _BITS) & 1).flatten(-2)  # [O, nb, 32]: bit j of qh is byte j / 8's bit j % 8
    qs = blk[..., 4:]
    return torch.cat([qs & 0xF, qs >> 4], dim=-1) | (high << 4)


def q5_codes(q: torch.Tensor) -> torch.Tensor:
    """The inverse of q5_values: values [O, nb, 32] (0..31) -> codes [O, nb * 20] uint8."""
    q = q.to(torch.int64)
    qh = ((q >> 4) << torch.arange(32)).sum(-1, keepdim=True)  # [O, nb, 1]
    qs = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)
    return torch.cat([_le_bytes(qh), qs.to(torch.uint8)], dim=-1).reshape(q.shape[0], -1)


def _q5_split(codes: torch.Tensor, values: bool = False):
    """codes [O, I/32 * 20] (values: 5-bit values as bytes [O, I]) -> (recover_q4's nibble codes [O, I/2],
    the high bits [P, PANEL, nb, 32] uint8)."""
    q = codes.reshape(codes.shape[0], -1, 32) if values else q5_values(codes)
    O, nb = q.shape[0], q.shape[1]
    nib = (q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)
    return nib.reshape(O, nb * 16), _pad_outputs(q >> 4, -(-O // PANEL)).reshape(-1, PANEL, nb, 32)


def _plane(high: torch.Tensor, layout: str) -> torch.Tensor:
    """One bit per weight [P, PANEL, nb, 32] (0/1 uint8) -> the exact arithmetic's plane [P, nb, 64]:
    "bytes", 32 little-endian uint16, word [i] bit l = the bit of output 16p + l, input 32b + i; "lanes",
    16 little-endian uint32, word [l] bit i = the same bit."""
    P, nb = high.shape[0], high.shape[2]
    if layout == "bytes":  # word [i] byte c bit l' = output 8c + l''s bit of input i
        plane = (high.reshape(P, 2, 8, nb, 32) << _BITS.reshape(8, 1, 1)).sum(2, dtype=torch.uint8)  # [P, c, nb, i]
        return plane.permute(0, 2, 3, 1).reshape(P, nb, 64)
    plane = (high.reshape(P, PANEL, nb, 4, 8) << _BITS).sum(-1, dtype=torch.uint8)  # [P, l, nb, c]: input 8c + i'
    return plane.permute(0, 2, 1, 3).reshape(P, nb, 64)


def _plane_i8(high: torch.Tensor, layout: str) -> torch.Tensor:
    """One bit per weight [P, PANEL, nb, 32] -> the int8 arithmetic's plane [P, nb, 64] for the build
    whose q4 layout is `layout` (pack_q5_i8's docstring)."""
    P, nb = high.shape[0], high.shape[2]
    high = high.reshape(P, PANEL, nb, 4, 2, 4)  # [P, l, nb, h, half, k]: input 32b + 8h + 4 half + k
    if layout == "bytes":  # mask byte j bit 4 lp + k: output l = 2j + lp, input 8h + 4 half + k
        shifts = (4 * torch.arange(2, dtype=torch.uint8).reshape(2, 1) + _BITS[:4]).reshape(2, 1, 1, 1, 4)
        masks = (high.reshape(P, 8, 2, nb, 4, 2, 4) << shifts).sum((2, 6), dtype=torch.uint8)  # [P, j, nb, h, half]
        return masks.permute(0, 2, 3, 4, 1).reshape(P, nb, 64)
    shifts = (_BITS[:4].reshape(4, 1, 1) + 4 * _BITS[:2].reshape(1, 2, 1))  # [h, half, 1]
    bits = (high << shifts).sum((3, 4), dtype=torch.uint8)  # [P, l, nb, k]
    return bits.permute(0, 2, 1, 3).reshape(P, nb, 64)


def pack_q5(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, layout: str = "bytes", values: bool = False):
    """Kind 12's (codes [O, I/32 * 20], d, m [O, I/32]) -> csrc/qlinear.c's q5 layout: codes [P, nb, 320]
    uint8, per panel-block pack_q4's 256 bytes of the low nibbles (in `layout`), then the 64-byte plane of
    the high bits: "bytes", 32 little-endian uint16, word [i] bit l = q[16p + l, 32b + i] >> 4; "lanes",
    16 little-endian uint32, word [l] bit i = the same bit; d, m [P, nb, 16] as pack_q4. `values`: codes
    are the 5-bit values as bytes [O, I] (kind 22: Q5_K's, with two-level records as d and m)."""
    nib, high = _q5_split(codes, values)
    lo, d, m = pack_q4(nib, d, m, layout)
    P, nb = lo.shape[0], lo.shape[1]
    return torch.cat([lo.reshape(P, nb, 256), _plane(high, layout)], dim=-1).contiguous(), d, m


def pack_q5_i8(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, layout: str = "bytes", values: bool = False):
    """Kind 12's (codes, d, m) -> csrc/qlinear_i8.c's q5 layout: codes [P, nb, 320] uint8, pack_q4_i8's
    4 chunks of 64 bytes (the low nibbles), then the plane of the high bits, as the build whose q4 layout
    is `layout` reads it: "bytes" (masks), per chunk h two little-endian uint64 masks over its 64 code
    bytes, bit 4l + k = q[16p + l, 32b + 8h + k] >> 4 (lo), then the same for input 8h + 4 + k (hi);
    "lanes" (shifts), byte [4l + k] bit h = q[16p + l, 32b + 8h + k] >> 4, bit 4 + h = q[16p + l,
    32b + 8h + 4 + k] >> 4 (h = 0..3: chunk h's high bits beside its nibbles). d, m as pack_q4_i8.

    Worked example, output l = 0 whose block holds q = 16..31 then 0..15: inputs 0..15 have bit 4, so
    "lanes" plane bytes 0..3 are 0x33 (h = 0, 1: bits 0, 1 and 4, 5); "masks" bytes 0, 8, 16, 24 are 0x0F."""
    if layout not in Q4_LAYOUTS:
        raise ValueError(f"q4 layout must be one of {Q4_LAYOUTS}, got {layout!r}")
    nib, high = _q5_split(codes, values)
    lo, d, m = pack_q4_i8(nib, d, m)
    P, nb = lo.shape[0], lo.shape[1]
    return torch.cat([lo.reshape(P, nb, 256), _plane_i8(high, layout)], dim=-1).contiguous(), d, m


# ---- 6-bit codes (kind 20): GGUF's Q6_K blocks, kind 18's codes q - 32 as 0..63 -------------------------
Q6_CHUNK = 256  # panels packed at a time: a head's temporaries stay tens of MB (its codes are 100 MB)


def pack_q6(codes: torch.Tensor, d: torch.Tensor, layout: str = "bytes", int8: bool = False):
    """Kind 20's (codes [O, I] uint8: kind 18's q - 32 as int8 bytes; d its records [O, I/256, 18]) ->
    codes [P, nb, 384] uint8: per panel-block the 6-bit values q' = q + 32 (0..63) as 256 bytes of low
    nibbles (pack_q4's layout in the exact arithmetic, pack_q4_i8's with `int8`), then the plane of bit 4
    and the plane of bit 5, each as kind 12 lays out its one plane for that arithmetic and `layout`;
    d as pack_scales (records), no min (the kernels form -32 d: csrc/qlinear.h v_off6).

    Worked example, output l = 0 whose first inputs hold q = -32, 31, 0: q' = 0, 63, 32, so the exact
    "bytes" nibble byte 0 is 0xF0 (inputs 0, 1), bit 4's plane word 1 and bit 5's words 1 and 2 have
    bit 0 set (inputs 1; 1 and 2)."""
    O, nb = codes.shape[0], codes.shape[1] // 32
    P = -(-O // PANEL)
    out = torch.empty(P, nb, 384, dtype=torch.uint8)
    plane = _plane_i8 if int8 else _plane
    for p0 in range(0, P, Q6_CHUNK):
        q = codes[PANEL * p0 : PANEL * (p0 + Q6_CHUNK)].view(torch.int8).reshape(-1, nb, 32)
        q = (q + 32).view(torch.uint8)  # [o, nb, 32]: 0..63
        n = -(-q.shape[0] // PANEL)
        nib = ((q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)).reshape(q.shape[0], nb * 16)
        lo = (pack_q4_i8(nib, None, None) if int8 else pack_q4(nib, None, None, layout))[0].reshape(n, nb, 256)
        bits = _pad_outputs(q >> 4, n).reshape(n, PANEL, nb, 32)  # 0..3: bit 4, bit 5
        out[p0 : p0 + n] = torch.cat([lo, plane(bits & 1, layout), plane(bits >> 1, layout)], dim=-1)
    return out, pack_scales(d, P), None


def pack_q8(codes: torch.Tensor, d: torch.Tensor):
    """recover_q8's (codes [O, I] int8, d [O, I/32], or [O, I/16] for a scale per 16 inputs) -> codes
    [P, nb, 32, 16] (byte [p, b, j, l] = q[16p + l, 32b + j]) and d [P, nb, 16] ([P, 2 nb, 16])."""
    O, nb = codes.shape[0], codes.shape[1] // 32
    P = -(-O // PANEL)
    q = _pad_outputs(codes.reshape(O, nb, 32), P).reshape(P, PANEL, nb, 32)
    return q.permute(0, 2, 3, 1).contiguous(), pack_scales(d, P)


def panel_scales(s: torch.Tensor, panels: int) -> torch.Tensor:
    """[O, nb] -> [P, nb, 16]: panel p's 16 outputs' scales of block b side by side (any dtype)."""
    nb = s.shape[1]
    return _pad_outputs(s, panels).reshape(panels, PANEL, nb).permute(0, 2, 1).contiguous()


def panel_records(r: torch.Tensor, panels: int) -> torch.Tensor:
    """Two-level records [O, S, 2 + k] uint8 (per super-block of 256 inputs: a float16's two bytes, then k
    sub-block scale bytes) -> [P, S, 32 + 16 k]: panel p's 16 float16 scales side by side, then per
    sub-block its 16 outputs' scale bytes side by side (csrc/qlinear.h; padded outputs all zero)."""
    S, w = r.shape[1], r.shape[2]
    r = _pad_outputs(r, panels).reshape(panels, PANEL, S, w)
    halves = r[..., :2].permute(0, 2, 1, 3).reshape(panels, S, 2 * PANEL)  # [P, S, l, byte]
    subs = r[..., 2:].permute(0, 2, 3, 1).reshape(panels, S, (w - 2) * PANEL)  # [P, S, k, l]
    return torch.cat([halves, subs], dim=-1).contiguous()


def pack_scales(s: torch.Tensor | None, panels: int) -> torch.Tensor | None:
    """A kind's scales or mins in the panel layout: [O, nb] values (panel_scales) or two-level records
    [O, S, 2 + k] (panel_records)."""
    if s is None:  # a min implied by the scale (kquants.implied_min): none held
        return None
    return panel_records(s, panels) if s.dim() == 3 else panel_scales(s, panels)
