"""Issue 55: Q6_K held as the file's 6-bit codes (kind 20: nibbles and two bit planes, 6.5625 bits per
weight) instead of 8-bit codes (kind 18, 8.5625): the same weights, and the same output bits in both
arithmetics on every ISA build, for one row, narrow and wide tiles and rebuilt panels; every code 0 or
63 against activations all +-127 (the int16 sums of the builds without VNNI widened every chunk)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trserve.engine.model.kernels.kquants import as_kind_18, decode, rebuild
from trserve.engine.model.kernels.pack import pack_q6
from tests.engine.model.test_kquants import qlinear_of, random_raw, raw_of, reference_i8, rows
from tests.engine.model.test_qlinear import isa_params, needs_kernel, reference_linear, wide_range_x
from tests.engine.model.test_qlinear_i8 import activations


def extreme_raw(O: int, I: int, top: bool, seed: int) -> np.ndarray:
    """Q6_K blocks whose every 6-bit value is 63 (top) or 0, random signed sub-block scales, d = 2^-8."""
    g = np.random.default_rng(seed)
    raw = np.zeros((O * I // 256, 210), np.uint8)
    raw[:, :192] = 0xFF if top else 0x00  # ql (low nibbles), qh (two high bits each)
    raw[:, 192:208] = g.integers(0, 256, (raw.shape[0], 16), dtype=np.uint8)
    raw[:, 208:210] = np.array([2.0 ** -8], np.float16).view(np.uint8)
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
def test_kind_20_gives_kind_18s_bits(isa, arithmetic, kernel_dir):
    x = wide_range_x(91, 512, seed=21) if arithmetic == "exact" else activations(91, 512, seed=21)
    for O, seed in ((21, 1), (40, 2), (16, 3)):
        for raw in (random_raw("Q6_K", O, 512, seed), raw_of("Q6_K", rows(O, 512, seed))):
            blocks = decode("Q6_K", raw, O, 512)
            bias = torch.randn(O, generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
            q6, q8 = (qlinear_of(b, bias, 512, O, kernel_dir, isa, arithmetic) for b in (blocks, as_kind_18(blocks)))
            assert (q6.kind, q8.kind) == (20, 18) and q6.codes.numel() * 4 == q8.codes.numel() * 3
            for n in (*range(1, 20), 80, 91):
                y = q6(x[:n])
                assert torch.equal(y, q8(x[:n])), f"{isa} {arithmetic} O={O} differs at n = {n}"
                assert not y.isnan().any()
    for top in (True, False):  # the largest integer sums, both signs
        blocks = decode("Q6_K", extreme_raw(19, 512, top, seed=4), 19, 512)
        q6 = qlinear_of(blocks, None, 512, 19, kernel_dir, isa, arithmetic)
        for x1 in (torch.ones(19, 512) * 0.5, -torch.ones(19, 512) * 0.5):
            ref = reference_i8(blocks, None, x1) if arithmetic == "int8" else reference_linear(rebuild(blocks), x1, None)
            y = q6(x1)
            assert torch.equal(y, ref) and torch.equal(y, qlinear_of(as_kind_18(blocks), None, 512, 19, kernel_dir, isa,
                                                                     arithmetic)(x1))
