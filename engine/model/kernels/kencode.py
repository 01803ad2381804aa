"""Encoders for GGUF's K-quant blocks (Q4_K, Q5_K, Q6_K), which gguf-py can read but not write: a
checkpoint quantized at load (engine/model/checkpoint.py) is encoded with them (and gguf-py's own
Q8_0/Q5_0 quantizers: `encode`), and the tests and the bench make the files users bring (a Q4_K_M of
the bundled model, a 1.7B-shaped one) with them, no llama.cpp build needed. Valid blocks in ggml's layout, scales chosen simply (max/min per
sub-block, not llama-quantize's search): a weight's error is larger than llama-quantize's, its format
the same, and gguf-py's dequantization reads them back (tests/engine/model/test_kquants.py checks it).

rows: float32 [n, k * 256] -> bytes [n, k * block bytes] uint8.
"""

from __future__ import annotations

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 [N] -> [N, 2] bytes of its float16 value."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _super_scales(v: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """v [N, S] >= 0 sub-block scales -> (super scale [N] as a float16 value, 6-bit codes [N, S])."""
    d = (v.max(-1) / top).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)
    return d, np.clip(np.rint(v / safe[:, None]), 0, top).astype(np.uint8)


def _pack_scale_min(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [N, 8] -> Q4_K/Q5_K's 12 packed bytes [N, 12] (gguf-py's get_scale_min, inverted)."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    mid = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return np.concatenate([lo, mid, hi], axis=-1).astype(np.uint8)


def _affine(rows: np.ndarray, levels: int):
    """Sub-blocks of 32 as d * sc * q - dmin * m: (d, dmin as float16 values [N], sc, m [N, 8], q [N, 8, 32])."""
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    low = np.maximum(0.0, -x.min(-1))  # [N, 8] the min subtracted (>= 0, as ggml stores it)
    span = (x.max(-1) + low) / levels
    d, sc = _super_scales(span, 63)
    dmin, m = _super_scales(low, 63)
    scale = d[:, None] * sc.astype(np.float32)
    shift = dmin[:, None] * m.astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint((x + shift[..., None]) / safe[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, m, np.where((scale > 0)[..., None], q, 0).astype(np.uint8)


def encode_q4_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    d, dmin, sc, m, q = _affine(rows, 15)
    qs = q.reshape(-1, 4, 2, 32)
    qs = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)  # low nibbles: sub-block 2k, high: 2k + 1
    return np.concatenate([_f16(d), _f16(dmin), _pack_scale_min(sc, m), qs], axis=-1).reshape(n, -1)


def encode_q5_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    d, dmin, sc, m, q = _affine(rows, 31)
    lo = (q & 0xF).reshape(-1, 4, 2, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(-1, 128)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)  # bit j: sub-block j
    return np.concatenate([_f16(d), _f16(dmin), _pack_scale_min(sc, m), qh, qs], axis=-1).reshape(n, -1)


def encode_q6_k(rows: np.ndarray) -> np.ndarray:
    n = rows.shape[0]
    x = rows.reshape(-1, 16, 16).astype(np.float32)
    amax = np.abs(x).max(-1)  # [N, 16]
    d = (amax.max(-1) / 31 / 127).astype(np.float16).astype(np.float32)  # sub-scales amax / 31 in 127 steps of d
    safe_d = np.where(d > 0, d, 1.0)
    sc = np.clip(np.rint(amax / 31 / safe_d[:, None]), 0, 127).astype(np.int8)
    scale = d[:, None] * sc.astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(x / safe[..., None]), -32, 31)
    u = (np.where((scale > 0)[..., None], q, 0) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [N, half, 128]
    lo, hi = u & 0xF, u >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(-1, 128)
    h = hi.reshape(-1, 2, 4, 32)
    qh = (h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=-1).reshape(n, -1)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}


def encode(type_name: str, rows: np.ndarray) -> np.ndarray:
    """float32 rows [n, I] -> their GGUF blocks of `type_name` [n, I / block * bytes] uint8: the K-quants
    here, the 32-weight types by gguf-py's quantizers (ggml's reference rounding)."""
    if type_name in ENCODERS:
        return ENCODERS[type_name](np.ascontiguousarray(rows, dtype=np.float32))
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(np.ascontiguousarray(rows, dtype=np.float32), GGMLQuantizationType[type_name])
