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

    Each block of 32 must be exactly q * d + m (q in 0..15, d and m float16 values): Q4_1's blocks, and
    Q4_0's ((q - 8) * d, so m = -8 d; d may be negative). Codes pack q_j in the low and q_{j+16} in the
    high nibble of byte j of the block, as both formats do.
    """
    O, I = w.shape
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
        return None
    blocks = w.reshape(O, I // 32, 32)
    m = blocks.amin(-1)  # [O, nb] the q = 0 element (Q4_1's form: q * d + m, both float16)
    tried = m.to(torch.float16).to(torch.float32) == m  # blocks that may be Q4_1's
    span = blocks.amax(-1) - m  # ~ 15 d
    best_q, best_d, ok_all = None, None, torch.zeros_like(m, dtype=torch.bool)
    for d in _fp16_candidates(span / 15, 2):  # the exact scale is span / 15 up to rounding
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((blocks - m[..., None]) / safe[..., None]).clamp(0, 15)
        q = torch.where((d > 0)[..., None], q, torch.zeros_like(q))
        ok = ((q * d[..., None] + m[..., None]) == blocks).all(-1) & tried & ~ok_all
        best_q = q if best_q is None else torch.where(ok[..., None], q, best_q)
        best_d = d if best_d is None else torch.where(ok, d, best_d)
        ok_all |= ok
        if bool(ok_all.all()):
            break
    if not bool(ok_all.all()):  # the rest as Q4_0's blocks, where they are (a Q4_1 block keeps its own form)
        q0, d0, m0, ok0 = _q4_0_form(blocks)
        use = ok0 & ~ok_all
        best_q, best_d, m = torch.where(use[..., None], q0, best_q), torch.where(use, d0, best_d), torch.where(use, m0, m)
        ok_all |= ok0
        if not bool(ok_all.all()):
            return None
    return _packed(best_q, best_d, m, O, I)


def every_linear_recovers(model, blocks: dict | None = None) -> bool:
    """Whether every nn.Linear of `model` rebuilds exactly as 4- or 8-bit blocks: what the native forward
    needs. Without it transformers' modules run the forward, whose tree rows are not the same bits as a
    plain step's; the int8 arithmetic turns such last-bit differences into other codes, then other
    tokens (tr == ar on 1 of 13 prompts for a Q4_K_M file, 13 of 13 in the exact arithmetic). `blocks`:
    the layers a GGUF file's K-quant blocks rebuild (engine/model/gguf_file.py:file_blocks), by module name."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return all(n in (blocks or {}) or recover_q4(m.weight.detach()) is not None or
               recover_q8(m.weight.detach()) is not None for n, m in linears)


def _packed(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, O: int, I: int):
    """q [O, nb, 32] codes 0..15, d and m [O, nb] -> (codes [O, I/2] uint8, d, m) as the kernel takes them."""
    q = q.to(torch.uint8)
    codes = (q[..., :16] | (q[..., 16:] << 4)).reshape(O, I // 2)
    return codes.contiguous(), d.contiguous(), m.contiguous()


def _q4_0_form(blocks: torch.Tensor):
    """blocks [O, nb, 32] -> (q, d, m, ok [O, nb]): each block as Q4_0 writes it, (q - 8) * d with d a
    float16 value, as q * d + m with m = -8 d (the same float32 value, exactly). ggml's Q4_0 takes d =
    x / -8 for the block's element x of largest magnitude (that element's code is 0), so d is read off it."""
    far = blocks.abs().argmax(-1, keepdim=True)  # [O, nb, 1]
    d = -blocks.gather(-1, far).squeeze(-1) / 8  # [O, nb] exact: a power of two
    ok = d.to(torch.float16).to(torch.float32) == d
    safe = torch.where(d != 0, d, torch.ones_like(d))
    q = torch.where((d != 0)[..., None], torch.round(blocks / safe[..., None]) + 8, torch.full_like(blocks, 8))
    q = q.clamp(0, 15)
    m = -8 * d
    ok &= ((q * d[..., None] + m[..., None]) == blocks).all(-1)
    return q, d, m, ok


def recover_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w: [O, I] float32 -> (codes [O, I] int8, d [O, I/32]) with every block exactly q * d, or None: Q8_0's
    blocks (the |q| = 127 element gives d), and Q5_0's ((q - 16) * d, codes -16..15; d may be negative)."""
    O, I = w.shape
    if I % 32 or w.dtype != torch.float32:  # the kernel takes blocks of 32
        return None
    blocks = w.reshape(O, I // 32, 32)
    q, d, ok = _multiple_form(blocks, blocks.abs().amax(-1) / 127, -127, 127)  # Q8_0
    if not bool(ok.all()):
        far = blocks.abs().argmax(-1, keepdim=True)  # Q5_0: d = x / -16 for the element x of largest magnitude
        q5, d5, ok5 = _multiple_form(blocks, -blocks.gather(-1, far).squeeze(-1) / 16, -16, 15)
        q, d, ok = torch.where(ok5[..., None], q5, q), torch.where(ok5, d5, d), ok | ok5
        if not bool(ok.all()):
            return None
    return q.to(torch.int8).reshape(O, I).contiguous(), d.contiguous()


def _multiple_form(blocks: torch.Tensor, d: torch.Tensor, lo: int, hi: int):
    """blocks [O, nb, 32], d [O, nb] -> (q, d, ok [O, nb]): where d is a float16 value and each block is
    exactly q * d with integer q in lo..hi."""
    ok = d.to(torch.float16).to(torch.float32) == d
    safe = torch.where(d != 0, d, torch.ones_like(d))
    q = torch.round(blocks / safe[..., None]).clamp(lo, hi)
    q = torch.where((d != 0)[..., None], q, torch.zeros_like(q))
    return q, d, ok & ((q * d[..., None]) == blocks).all(-1)
