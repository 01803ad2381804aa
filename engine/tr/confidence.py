"""Confidence beside each matrix id: the probability the model gave that successor when the row was
recycled, stored as one byte (uint8 bucket q = round(255 p); 0 = unknown: a row recycled before
confidences were kept, an ids-only snapshot or peer). 1.9 MB instead of 1.5 MB (V x K x 5 bytes) at V=49152, K=8.

Torch-free helpers work on numpy arrays and torch tensors alike (the store and the matrix service
hold numpy, the engine torch).

Example: p = [0.9, 0.05, 0.0001] -> q = [230, 13, 0] -> decoded [0.902, 0.051, 0.0 (unknown)].
"""

from __future__ import annotations

import numpy as np

SCALE = 255.0


def encode(p):
    """Probabilities in [0, 1] (float numpy array or torch tensor) -> uint8 buckets, same kind."""
    if isinstance(p, np.ndarray):
        return np.clip(np.rint(p * SCALE), 0, SCALE).astype(np.uint8)
    return (p * SCALE).round().clamp(0, SCALE).byte()


def decode(q):
    """uint8 buckets -> probabilities (float32), same kind; 0 stays 0 (unknown)."""
    if isinstance(q, np.ndarray):
        return q.astype(np.float32) / np.float32(SCALE)
    return q.float() / SCALE
