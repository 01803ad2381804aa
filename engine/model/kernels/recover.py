"""Exact recovery of block-quantised weights: float32 [O, I] -> the 4/8-bit codes and float16 block
scales that rebuild it bit for bit, or None (pure tensor functions; the kernels' input)."""

from __future__ import annotations

import torch


def _fp16_candidates(v: torch.Tensor, steps: int):
    """v rounded to float16, then its float16 neighbours 1..steps ulps away (positive, finite), as float32."""
    bits = v.to(torch.float16).view(torch.int16).to(torch.int32)
    for s in [0] + [x for k in range(1, steps + 1) for x in (-k, k)]:
        b = (bits + s).clamp(0, 0x7BFF).to(torch.int16)
        yield b.view(torch.float16).to(torch.float32)


def recover_q4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w: [O, I] float32, I % 32 == 0 -> (codes [O, I/2] uint8, d [O, I/32], m [O, I/32]) or None.

    Each block of 32 must be exactly q * d + m (q in 0..15, d and m float16 values). Codes pack
    q_j in the low and q_{j+16} in the high nibble of byte j of the block.
    """
    O, I = w.shape
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
        return None
    blocks = w.reshape(O, I // 32, 32)
    m = blocks.amin(-1)  # [O, nb] the q = 0 element
    if not torch.equal(m.to(torch.float16).to(torch.float32), m):
        return None
    span = blocks.amax(-1) - m  # ~ 15 d
    best_q, best_d, ok_all = None, None, torch.zeros_like(m, dtype=torch.bool)
    for d in _fp16_candidates(span / 15, 2):  # the exact scale is span / 15 up to rounding
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15)
        q = torch.where((d > 0)[..., None], q, torch.zeros_like(q))
        ok = ((q * d[..., None] + m[..., None]) == blocks).all(-1) & ~ok_all
        best_q = q if best_q is None else torch.where(ok[..., None], q, best_q)
        best_d = d if best_d is None else torch.where(ok, d, best_d)
        ok_all |= ok
        if bool(ok_all.all()):
            break
    if not bool(ok_all.all()):
        return None
    q = best_q.to(torch.uint8)  # [O, nb, 32]
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(O, I // 2)
    return codes.contiguous(), best_d.contiguous(), m.contiguous()


def recover_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w: [O, I] float32 -> (codes [O, I] int8, d [O, I/32]) with every block exactly q * d, or None."""
    O, I = w.shape
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
        return None
    blocks = w.reshape(O, I // 32, 32)
    d = blocks.abs().amax(-1) / 127  # the |q| = 127 element gives d exactly
    if not torch.equal(d.to(torch.float16).to(torch.float32), d):
        return None
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(blocks / safe[..., None]).clamp(-128, 127)
    if not torch.equal(q * d[..., None], blocks):
        return None
    return q.to(torch.int8).reshape(O, I).contiguous(), d.contiguous()
