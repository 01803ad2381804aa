"""A GGUF file's K-quant (and Q5_0, Q5_1) blocks as the kernels hold them: the codes and the file's own
scales, which rebuild each weight to exactly the float32 value ggml (and gguf-py, hence transformers)
dequantizes it to (pure array functions; engine/model/gguf_file.py maps a model's layers to them).

Per 256 weights (a super-block), from ggml's block layouts:
  Q4_K: w = (d * sc) * q - dmin * mn, q in 0..15, sc and mn 6-bit per 32 weights   -> kind 6
  Q5_K: the same with q in 0..31                                                   -> kind 22 (10)
  Q6_K: w = (d * sc) * q, q in -32..31, sc a signed byte per 16 weights            -> kind 20 (18)
  Q5_1 (per 32): w = d * q + m, q in 0..31, d and m float16                         -> kind 12
  Q5_0 (per 32): w = (q - 16) * d = q * d + m, m = -16 d implied (no min held)      -> kind 12
  Q4_0, Q4_1, Q8_0 (per 32): the float16 kinds 4 and 8 (Q4_0 as q * d + m, m = -8 d implied), as
  recover.py finds them in float weights
Kind 12 holds the file's code bytes as they are (per block qh, then qs: pack.py's q5_values) and float16
d, and m for Q5_1: 5.5 bits per weight for Q5_0, 6 for Q5_1, as the file; Q4_0 4.5 (`implied_min`); `widen` gives the same blocks as kind 9 (8-bit codes,
float32 d and m: the kernels' reference for kind 12, and what Q5_0/Q5_1 were held as before).
The K-quants keep their two levels (csrc/qlinear.h): per row and super-block a record of the float16
d's two bytes (little-endian) and the sub-block scales as bytes (d [O, I/256, 10]: d, then sc of the
8 blocks of 32; kind 18: d [O, I/256, 18], d then the 16 int8 sc), and for kinds 6 and 10 the min's
record likewise (m: dmin, then the 8 mn). The kernels form d * sc and -(dmin * mn) in registers: d * sc
is exact in float32 (11 x 8 bits), and so is its product with q (at most 24 bits), so code * scale
(+ min) rounds at most once: the kernels' weight is ggml's bit for bit. So Q4_K is held at 4 + 16/32 +
32/256 = 4.625 bits per weight (the file: 4.5), Q5_K at 8.625 (8-bit codes), Q6_K at 8.5625.
Kind 22 takes kind 10's arrays (5-bit codes as bytes [O, I]) and holds them as kind 12 does (nibbles and
a plane of bit 4, pack.py: pack_q5): 5.625 bits per weight (the file: 5.5); kind 10's weights and
outputs bit for bit. Kind 20 takes kind 18's arrays (codes q - 32 as bytes [O, I]) and holds them as the file's 6-bit
codes (nibbles and two bit planes, pack.py: pack_q6): 6.5625 bits per weight, the file's; the same
weights and outputs, bit for bit, as kind 18 (`as_8bit` gives kinds 18 and 10: the kernels' reference).
`expand` gives the same blocks with the products as float32 (kinds 5, 9, 17: the kernels' reference
kinds), `rebuild` the float32 matrix.
"""

from __future__ import annotations

import numpy as np
import torch

from .pack import Q5_BLOCK, q5_values

QK_K = 256
# bytes per block: per super-block of 256 for the K-quants, per 32 for the others
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q5_1": 24, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
KIND = {"Q4_K": 6, "Q5_K": 22, "Q6_K": 20, "Q5_1": 12, "Q4_0": 4, "Q4_1": 4, "Q5_0": 12, "Q8_0": 8}
# A layer's blocks: (kind, codes [O, I/2], [O, I/32 * 20] (kind 12) or [O, I] uint8, d, m or None): d, m
# [O, I/32] float32 (kind 17:
# d [O, I/16]), or the two-level kinds' records [O, I/256, 10] uint8 (kind 18: d [O, I/256, 18])
Blocks = tuple
TWO_LEVEL = {6: 5, 10: 9, 18: 17, 20: 17, 22: 9}  # a two-level kind -> the kind holding its products as float32


def _f16(b: np.ndarray) -> np.ndarray:
    """[N, 2] bytes -> [N, 1] float32 (the float16 values they hold)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes [N, 12] -> the 8 sub-blocks' 6-bit scales and mins, each [N, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def decode(kind_name: str, raw: np.ndarray, O: int, I: int) -> Blocks:
    """raw: the tensor's bytes [O, I / block * BLOCK_BYTES] uint8 (GGUF's row-major blocks) -> its Blocks.

    Worked example (Q6_K, one row of 256): d = 0.5 and the first sub-block's sc = -3 (the record
    d[o, 0] = 00 38 fd ..., float16 0.5's bytes, then sc) give that sub-block's scale -1.5 (expand's d[o, 0]);
    a 6-bit value 40 there is code 8, weight -12.0."""
    if kind_name not in BLOCK_BYTES:
        raise ValueError(f"no K-quant decoder for {kind_name}")
    blocks = np.ascontiguousarray(raw).reshape(-1, BLOCK_BYTES[kind_name])  # [N, bytes]
    if kind_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return _legacy(kind_name, blocks, O, I)
    if kind_name == "Q6_K":
        ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], blocks[:, 208:]
        lo = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        hi = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 0x03
        q = (lo.reshape(-1, 8, 32) | (hi.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)  # [N, 8, 32]
        return 20, q.reshape(O, I).view(np.uint8), _records(d, sc, O, I), None
    sc, mn = _scale_min(blocks[:, 4:16])
    scale, low = _records(blocks[:, 0:2], sc, O, I), _records(blocks[:, 2:4], mn, O, I)  # d, sc; dmin, mn
    if kind_name == "Q4_K":
        q = (blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        q = q.reshape(-1, 8, 32)
        codes = q[..., :16] | (q[..., 16:] << 4)  # recover_q4's packing: byte j = q_j | q_{j+16} << 4
        return 6, codes.reshape(O, I // 2), scale, low
    qh, qs = blocks[:, 16:48], blocks[:, 48:]  # Q5_K
    lo = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
    q = lo.reshape(-1, 8, 32) | (hi << 4)
    return 22, q.reshape(O, I), scale, low


def _records(half: np.ndarray, sub: np.ndarray, O: int, I: int) -> np.ndarray:
    """A super-block's float16 scale's bytes [N, 2] and its sub-block scales [N, k] (bytes) -> the
    two-level records [O, I/256, 2 + k] uint8."""
    return np.concatenate([half, sub.view(np.uint8)], axis=-1).reshape(O, I // QK_K, -1)


def expand(blocks: Blocks) -> Blocks:
    """Two-level blocks (kinds 6, 10, 18) -> the same blocks with each sub-block's scale d * sc and min
    -(dmin * mn) as float32 values (kinds 5, 9, 17; exact products, the values the kernels form in
    registers); other kinds as they are."""
    kind, codes, d, m = blocks
    if kind not in TWO_LEVEL:
        return blocks
    O = codes.shape[0]

    def products(rec: np.ndarray, signed: bool) -> np.ndarray:
        sub = rec[..., 2:].view(np.int8) if signed else rec[..., 2:]
        return (_f16(rec[..., :2].reshape(-1, 2)).reshape(*rec.shape[:2], 1) * sub.astype(np.float32)).reshape(O, -1)

    return TWO_LEVEL[kind], codes, products(d, kind in (18, 20)), None if m is None else -products(m, False)


EIGHT_BIT = {20: 18, 22: 10}  # a kind held in fewer bits -> the kind holding the same arrays as 8-bit codes


def as_8bit(blocks: Blocks) -> Blocks:
    """Kind 20's or 22's blocks (Q6_K, Q5_K as 6- and 5-bit codes) -> the same arrays as kinds 18 and 10
    (8-bit codes: the same weights and outputs; the tests' reference); other kinds as they are."""
    return (EIGHT_BIT[blocks[0]], *blocks[1:]) if blocks[0] in EIGHT_BIT else blocks


def _legacy(kind_name: str, blocks: np.ndarray, O: int, I: int) -> Blocks:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks [N, bytes] -> kinds 4, 12 and 8 (scales float16 values, held as
    float32). Q5_0's and Q5_1's codes are the blocks' qh and qs bytes as they lie."""
    d = _f16(blocks[:, 0:2])
    if kind_name == "Q8_0":
        return 8, np.ascontiguousarray(blocks[:, 2:]).reshape(O, I), d.reshape(O, I // 32), None
    if kind_name == "Q5_1":
        codes = np.ascontiguousarray(blocks[:, 4:4 + Q5_BLOCK]).reshape(O, -1)
        return 12, codes, d.reshape(O, -1), _f16(blocks[:, 2:4]).reshape(O, -1)
    if kind_name == "Q5_0":  # (q - 16) * d = q * d + (-16 d): the min implied (m None), as the file holds it
        return 12, np.ascontiguousarray(blocks[:, 2:2 + Q5_BLOCK]).reshape(O, -1), d.reshape(O, -1), None
    if kind_name == "Q4_1":  # byte j holds q_j low and q_{j+16} high: recover_q4's packing already
        return 4, np.ascontiguousarray(blocks[:, 4:]).reshape(O, I // 2), d.reshape(O, -1), \
            _f16(blocks[:, 2:4]).reshape(O, -1)
    # Q4_0: (q - 8) * d = q * d + (-8 d), the min implied
    return 4, np.ascontiguousarray(blocks[:, 2:]).reshape(O, I // 2), d.reshape(O, -1), None


IMPLIED = {4: -8.0, 12: -16.0}  # the min of kinds 4 and 12 held without one (Q4_0, Q5_0): this times d


def implied_min(blocks: Blocks) -> Blocks:
    """Kind 4 or 12 blocks held without a min (a file's Q4_0 / Q5_0: m None) -> the same with m = -8 d or
    -16 d as float32 values (exact: a power of two times a float16 value; the kernels form it in registers,
    csrc/qlinear.h: v_min_of); other blocks as they are."""
    kind, codes, d, m = blocks
    if m is not None or kind not in IMPLIED:
        return blocks
    return kind, codes, d, np.float32(IMPLIED[kind]) * np.asarray(d, np.float32)


def widen(blocks: Blocks) -> Blocks:
    """Kind 12's blocks -> the same weights as kind 9's (8-bit codes 0..31 [O, I], d and m float32: the
    same products and mins, so the same bits in both arithmetics); other kinds as they are."""
    kind, codes, d, m = implied_min(blocks)
    if kind != 12:
        return blocks
    q = q5_values(torch.as_tensor(np.asarray(codes))).numpy()
    return 9, q.reshape(q.shape[0], -1), np.asarray(d, np.float32), np.asarray(m, np.float32)


def rebuild(blocks: Blocks) -> torch.Tensor:
    """Blocks -> the float32 weight [O, I] the kernels compute with (code * scale (+ min), one rounding;
    a Q5_0 weight that ggml makes -0.0, q = 16 with a negative d, is +0.0 here: the same value)."""
    kind, codes, d, m = expand(widen(implied_min(blocks)))
    codes, d = torch.as_tensor(np.asarray(codes)), torch.as_tensor(np.asarray(d))
    O = codes.shape[0]
    if kind in (4, 5):
        q = torch.cat([codes.reshape(O, -1, 16) & 0xF, codes.reshape(O, -1, 16) >> 4], dim=-1).to(torch.float32)
    else:
        q = codes.view(torch.int8).reshape(O, d.shape[1], -1).to(torch.float32)  # [O, scales, 32 or 16]
    w = q.reshape(O, d.shape[1], -1) * d[..., None]
    if m is not None:
        w = w + torch.as_tensor(np.asarray(m))[..., None]
    return w.reshape(O, -1)
