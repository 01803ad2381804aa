"""Issue 55: Q6_K held as the file's 6-bit codes (kind 20: nibbles and two bit planes, 6.5625 bits per
weight) instead of 8-bit codes (kind 18, 8.5625), and Q5_K as 5-bit codes (kind 22: kind 12's nibbles and
plane, 5.625 bits) instead of kind 10's 8-bit ones (8.625): the same weights, and the same output bits in
both arithmetics on every ISA build, for one row, narrow and wide tiles and rebuilt panels; every code
at its top or 0 against activations all +-127 (the int16 sums of the builds without VNNI widened in time)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trserve.engine.model.kernels.kquants import BLOCK_BYTES, as_8bit, decode, rebuild
from trserve.engine.model.kernels.pack import pack_q6
from tests.engine.model.test_kquants import qlinear_of, random_raw, raw_of, reference_i8, rows
from tests.engine.model.test_qlinear import isa_params, needs_kernel, reference_linear, wide_range_x
from tests.engine.model.test_qlinear_i8 import activations


def extreme_raw(kind_name: str, O: int, I: int, top: bool, seed: int) -> np.ndarray:
    """Q6_K (Q5_K) blocks whose every value is 63 (31) for `top`, else 0, random sub-block scales (and
    mins), super-block scales 2^-8."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (O * I // 256, BLOCK_BYTES[kind_name]), dtype=np.uint8)
    half = np.array([2.0 ** -8], np.float16).view(np.uint8)
    if kind_name == "Q6_K":  # ql, qh; sc random; d
        raw[:, :192], raw[:, 208:210] = 0xFF if top else 0x00, half
    else:  # d, dmin; 12 scale bytes random; qh, qs
        raw[:, 0:2], raw[:, 2:4], raw[:, 16:] = half, half, 0xFF if top else 0x00
    return raw.reshape(O, -1)


def test_pack_q6_worked_example():
    """pack_q6's docstring: q = -32, 31, 0 at inputs 0, 1, 2 of output 0 -> q' = 0, 63, 32."""
    codes = torch.zeros(1, 256, dtype=torch.int8)
    codes[0, :3] = torch.tensor([-32, 31, 0], dtype=torch.int8)
    codes[0, 3:] = -32  # q' = 0 elsewhere
    out, d, m = pack_q6(codes.view(torch.uint8), torch.zeros(1, 1, 18, dtype=torch.uint8), "bytes")
    assert out.shape == (1, 8, 384) and m is None and d.shape == (1, 1, 32 + 16 * 16)
    blk = out[0, 0]
    assert blk[0] == 0xF0 and blk[1:256].eq(0).all()  # inputs 0, 1 of output 0: nibbles 0 and 15
    b4 = blk[256:320].view(torch.int16)  # word [i] bit l: output l's bit 4 at input i
    b5 = blk[320:384].view(torch.int16)
    assert b4.tolist() == [0, 1] + [0] * 30 and b5.tolist() == [0, 1, 1] + [0] * 29


@needs_kernel
@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("kind_name, kinds, bits", [("Q6_K", (20, 18), 6), ("Q5_K", (22, 10), 5)])
def test_fewer_bit_kinds_give_the_8_bit_kinds_bits(isa, arithmetic, kind_name, kinds, bits, kernel_dir):
    x = wide_range_x(91, 512, seed=21) if arithmetic == "exact" else activations(91, 512, seed=21)
    for O, seed in ((21, 1), (40, 2), (16, 3)):
        for raw in (random_raw(kind_name, O, 512, seed), raw_of(kind_name, rows(O, 512, seed))):
            blocks = decode(kind_name, raw, O, 512)
            bias = torch.randn(O, generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
            few, q8 = (qlinear_of(b, bias, 512, O, kernel_dir, isa, arithmetic) for b in (blocks, as_8bit(blocks)))
            assert (few.kind, q8.kind) == kinds and few.codes.numel() * 8 == q8.codes.numel() * bits
            for n in (*range(1, 20), 80, 91):
                y = few(x[:n])
                assert torch.equal(y, q8(x[:n])), f"{isa} {arithmetic} {kind_name} O={O} differs at n = {n}"
                assert not y.isnan().any()
    for top in (True, False):  # the largest integer sums, both signs
        blocks = decode(kind_name, extreme_raw(kind_name, 19, 512, top, seed=4), 19, 512)
        few = qlinear_of(blocks, None, 512, 19, kernel_dir, isa, arithmetic)
        for x1 in (torch.ones(19, 512) * 0.5, -torch.ones(19, 512) * 0.5):
            ref = reference_i8(blocks, None, x1) if arithmetic == "int8" else reference_linear(rebuild(blocks), x1, None)
            y = few(x1)
            assert torch.equal(y, ref) and torch.equal(y, qlinear_of(as_8bit(blocks), None, 512, 19, kernel_dir, isa,
                                                                     arithmetic)(x1))
