"""Issue 55: a GGUF file's K-quant blocks (Q4_K, Q5_K, Q6_K), Q5_0 and Q5_1 read as they are onto the kernels
(kinds 6, 10, 18: the file's two-level scales; 12: 5-bit codes): the test encoder against gguf-py, the decoder's
weights against gguf-py's dequantization bit for bit, and both arithmetics' kernels against op-by-op
references on every ISA build this CPU runs (the rotary row order: the tiny GQA model of
test_user_files.py). The two-level kinds hold the file's bytes per weight (Q4_K 4.625 bits) and give
the bits of the kinds holding their scales as float32 products (5, 9, 17); kind 12 gives kind 9's bits
(its codes widened to bytes, its scales to float32) and, in the exact arithmetic, Q5_0's old kind 8's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trserve.engine.model.kernels.kencode import ENCODERS
from trserve.engine.model.kernels.build import available_isas
from trserve.engine.model.kernels.kquants import BLOCK_BYTES, decode, expand, implied_min, rebuild, widen
from trserve.engine.model.kernels.pack import pack_q5_i8, q5_codes, q5_values
from trserve.engine.model.kernels.qlinear import QLinear
from tests.engine.model.test_qlinear import fma32, isa_params, needs_kernel, reference_linear, wide_range_x
from tests.engine.model.test_qlinear_i8 import activations, reference_quant

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402


def rows(O: int, I: int, seed: int) -> np.ndarray:
    """Weights with the spread of a trained layer's: mostly small, some rows shifted, one all zero."""
    g = np.random.default_rng(seed)
    w = (g.standard_normal((O, I)) * 0.03).astype(np.float32)
    w[1] += 0.05  # a row with no negative minimum in most sub-blocks
    w[2, :256] = 0.0
    w[:, 7] *= 20  # an outlier column
    return w


def raw_of(kind_name: str, w: np.ndarray) -> np.ndarray:
    return ENCODERS[kind_name](w) if kind_name in ENCODERS else quants.quantize(w, T[kind_name])


TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_1", "Q5_0"]


@pytest.mark.parametrize("kind_name", TYPES)
def test_blocks_rebuild_ggufs_dequantized_weights_bit_for_bit(kind_name):
    w = rows(40, 512, seed=1)
    raw = raw_of(kind_name, w)
    want = quants.dequantize(raw, T[kind_name])  # what transformers loads from the file
    blocks = decode(kind_name, raw, 40, 512)
    got = rebuild(blocks).numpy()
    if kind_name == "Q5_0":  # ggml's (q - 16) * d is -0.0 at q = 16 with d < 0; q * d + (-16 d) is +0.0
        assert (want.view(np.uint32) == 0x80000000).any() and not (got.view(np.uint32) == 0x80000000).any()
        want = want + np.float32(0.0)  # -0.0 -> +0.0, every other value's bits as they are
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    err = np.abs(want - w).max() / np.abs(w).max()
    assert err < {"Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02, "Q5_1": 0.04, "Q5_0": 0.04}[kind_name], err
    assert not np.array_equal(want, w)


def test_q6_k_worked_example():
    """decode's docstring: d = 0.5, the first sub-block's sc = -3, a 6-bit value 40 -> code 8, weight -12;
    the record holds the file's bytes, expand the product."""
    block = np.zeros(210, np.uint8)
    block[0] = 40 & 0xF  # ql: low nibble of element 0
    block[128] = 40 >> 4  # qh: its two high bits
    block[192] = np.int8(-3).view(np.uint8)
    block[208:210] = np.array([0.5], np.float16).view(np.uint8)
    kind, codes, d, m = decode("Q6_K", block[None], 1, 256)
    assert kind == 20 and m is None and d.shape == (1, 1, 18) and d.dtype == np.uint8
    assert list(d[0, 0, :3]) == [0x00, 0x38, 0xFD]
    assert codes.view(np.int8)[0, 0] == 8 and expand((kind, codes, d, m))[2][0, 0] == -1.5
    assert rebuild((kind, codes, d, m))[0, 0] == -12.0
    assert np.array_equal(quants.dequantize(block[None], T.Q6_K)[0, :1], [-12.0])


def layer(kind_name: str, O: int, I: int, seed: int, isa: str, kernel_dir, arithmetic: str):
    w = rows(O, I, seed)
    blocks = decode(kind_name, raw_of(kind_name, w), O, I)
    kind, codes, d, m = blocks
    bias = torch.randn(O, generator=torch.Generator().manual_seed(seed)) * 0.1 if seed % 2 else None
    q = QLinear(kind, torch.from_numpy(codes), torch.from_numpy(d), None if m is None else torch.from_numpy(m),
                bias, I, O, kernel_dir, isa, arithmetic)
    return blocks, bias, q



SHAPES = [("Q4_K", 40, 512, 3), ("Q5_K", 37, 256, 4), ("Q6_K", 21, 512, 5), ("Q5_1", 33, 96, 6), ("Q5_0", 35, 160, 8)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("isa", isa_params())
def test_exact_kernel_equals_the_reference_on_ggufs_weights(isa, shape, kernel_dir):
    """Bits of one fma chain per output over ggml's dequantized weights, for 1..19 rows (one row, narrow
    and wide tiles) and 80/91 rows (rebuilt panels), and every row alone."""
    kind_name, O, I, seed = shape
    blocks, bias, q = layer(kind_name, O, I, seed, isa, kernel_dir, "exact")
    x = wide_range_x(91, I, seed=seed)
    ref = reference_linear(rebuild(blocks), x, bias)
    for n in (*range(1, 20), 80, 91):
        assert torch.equal(q(x[:n]), ref[:n]), f"{isa} {kind_name} differs at n = {n}"
    for i in range(0, 19, 3):
        assert torch.equal(q(x[i : i + 1]), ref[i : i + 1])


def reference_i8(blocks, bias, x: torch.Tensor) -> torch.Tensor:
    """csrc/qlinear_i8.c's op order for kinds 5, 9, 17 (and 6, 10, 18: their products; 12: kind 9's
    codes and scales): per block, f = isum * s, acc = fma(f, d, acc) (kind 17: each half's isum with its
    own d), then the min: acc = fma(m, c * s, acc)."""
    kind, codes, d, m = expand(widen(blocks))
    codes, d = torch.from_numpy(codes), torch.from_numpy(d)
    O = codes.shape[0]
    if kind == 5:
        c = codes.reshape(O, -1, 16).to(torch.int64)
        wq = torch.cat([c & 0xF, c >> 4], dim=-1)  # [O, nb, 32]
    else:
        wq = codes.view(torch.int8).reshape(O, -1, 32).to(torch.int64)
    xq, s, c = reference_quant(x)  # [n, nb, 32], [n, nb], [n, nb]
    halves = 2 if kind == 17 else 1
    acc = torch.zeros(x.shape[0], O)
    for b in range(wq.shape[1]):
        for h in range(halves):
            part = slice(32 * h // halves, 32 * (h + 1) // halves)
            isum = torch.einsum("rj,oj->ro", xq[:, b, part], wq[:, b, part])
            f = isum.float() * s[:, b, None]
            acc = fma32(f, d[None, :, halves * b + h].expand_as(acc), acc)
        if m is not None:
            xm = (c[:, b].float() * s[:, b])[:, None]
            acc = fma32(torch.from_numpy(m)[None, :, b].expand_as(acc), xm.expand_as(acc), acc)
    return acc + bias if bias is not None else acc


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("isa", isa_params())
def test_int8_kernel_equals_its_reference_on_ggufs_blocks(isa, shape, kernel_dir):
    kind_name, O, I, seed = shape
    blocks, bias, q = layer(kind_name, O, I, seed, isa, kernel_dir, "int8")
    x = activations(19, I, seed=seed)
    ref = reference_i8(blocks, bias, x)
    for n in range(1, 20):
        assert torch.equal(q(x[:n]), ref[:n]), f"{isa} {kind_name} differs at n = {n}"
    for i in range(19):
        assert torch.equal(q(x[i : i + 1]), ref[i : i + 1])
    exact = x @ rebuild(blocks).T + (bias if bias is not None else 0)
    assert (ref - exact).norm() / exact.norm() < 0.02  # the int8 arithmetic stays near the weights' own


@needs_kernel
@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
def test_every_build_gives_the_same_bits_on_k_blocks(arithmetic, kernel_dir):
    x = activations(24, 512, seed=9)
    for kind_name in ("Q4_K", "Q6_K"):
        outs = {isa: layer(kind_name, 40, 512, 7, isa, kernel_dir, arithmetic)[2](x) for isa in available_isas()}
        for isa, y in outs.items():
            assert torch.equal(y, outs["scalar"]), f"{isa} != scalar ({kind_name}, {arithmetic})"


def test_qlinear_checks_k_block_shapes(kernel_dir):
    kind, codes, d, m = (torch.from_numpy(a) if isinstance(a, np.ndarray) else a
                         for a in decode("Q4_K", ENCODERS["Q4_K"](rows(16, 256, 1)), 16, 256))
    with pytest.raises(ValueError, match="do not match"):
        QLinear(kind, codes, d, None, None, 256, 16, kernel_dir, "scalar")
    with pytest.raises(ValueError, match="do not match"):  # float32 products are kind 5's, not 6's
        QLinear(kind, codes, *(torch.from_numpy(a) for a in expand((kind, codes.numpy(), d.numpy(), m.numpy()))[2:]),
                None, 256, 16, kernel_dir, "scalar")
    with pytest.raises(ValueError, match="byte records"):
        QLinear(kind, codes, d.float(), m, None, 256, 16, kernel_dir, "scalar")
    with pytest.raises(ValueError, match="kinds"):
        QLinear(7, codes, d, m, None, 256, 16, kernel_dir)
    with pytest.raises(ValueError, match="256"):  # two-level scales come per super-block of 256 inputs
        QLinear(kind, codes[:, :64], d, m, None, 128, 16, kernel_dir, "scalar")
    assert isinstance(QLinear(kind, codes, d, m, None, 256, 16, kernel_dir, "scalar"), nn.Module)


def random_raw(kind_name: str, O: int, I: int, seed: int) -> np.ndarray:
    """A K-quant tensor's bytes with every field random (codes, 6-bit or signed sub-block scales), its
    float16 super-block scales of either sign from subnormal (2^-24) to 6 (no overflow downstream)."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (O * I // 256, BLOCK_BYTES[kind_name]), dtype=np.uint8)
    n = raw.shape[0]

    def halves(k: int) -> np.ndarray:
        v = g.choice([-1.0, 1.0], (n, k)) * 2.0 ** g.integers(-24, 2, (n, k)) * (1 + g.random((n, k)) * 2)
        v[g.random((n, k)) < 0.05] = 0.0
        return v.astype(np.float16).view(np.uint8).reshape(n, 2 * k)

    if kind_name == "Q6_K":
        raw[:, 208:210] = halves(1)
    else:
        raw[:, 0:4] = halves(2)
    return raw.reshape(O, -1)


@needs_kernel
@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
@pytest.mark.parametrize("isa", isa_params())
def test_two_level_kinds_give_the_float32_kinds_bits(isa, arithmetic, kernel_dir):
    """Kinds 6, 10, 18 (the file's scales, the products formed in registers) against 5, 9, 17 (the same
    products held as float32) on the same blocks: the same bits for 1..19 rows (one row, narrow and wide
    tiles) and 80/91 rows (the exact arithmetic's rebuilt panels), with biases, ragged panels, random
    scale bytes and float16 scales down to subnormals."""
    x = wide_range_x(91, 512, seed=11) if arithmetic == "exact" else activations(91, 512, seed=11)
    for kind_name, O, seed in (("Q4_K", 37, 1), ("Q5_K", 40, 2), ("Q6_K", 21, 3), ("Q4_K", 16, 4)):
        for raw in (random_raw(kind_name, O, 512, seed), raw_of(kind_name, rows(O, 512, seed))):
            two = decode(kind_name, raw, O, 512)
            bias = torch.randn(O, generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
            q2, q32 = (QLinear(b[0], *(None if a is None else torch.from_numpy(a) for a in b[1:]), bias, 512, O,
                               kernel_dir, isa, arithmetic) for b in (two, expand(two)))
            assert (q2.kind, q32.kind) == ({"Q4_K": 6, "Q5_K": 22, "Q6_K": 20}[kind_name], {6: 5, 22: 9, 20: 17}[q2.kind])
            for n in (*range(1, 20), 80, 91):
                y = q2(x[:n])
                assert torch.equal(y, q32(x[:n])), f"{isa} {arithmetic} {kind_name} O={O} differs at n = {n}"
                assert not y.isnan().any()


@pytest.mark.parametrize("kind_name, bits", [("Q4_K", 4.625), ("Q5_K", 5.625), ("Q6_K", 6.5625)])
def test_two_level_kinds_hold_the_files_bytes_per_weight(kind_name, bits, kernel_dir):
    """Codes, scales and mins as QLinear holds them (both arithmetics' layouts), per weight: Q4_K 4 + 16/32 +
    32/256 bits (the file: 4.5; float32 products: 6), Q5_K 5.625 (the file: 5.5; as kind 10's 8-bit codes
    8.625), Q6_K 6 + 8/16 + 16/256 (the file's; as kind 18's 8-bit codes it was 8.5625)."""
    O, I = 64, 1024
    blocks = decode(kind_name, raw_of(kind_name, rows(O, I, 5)), O, I)
    for arithmetic in ("exact", "int8"):
        q = QLinear(blocks[0], *(None if a is None else torch.from_numpy(a) for a in blocks[1:]), None, I, O,
                    kernel_dir, "scalar", arithmetic)
        held = sum(b.numel() * b.element_size() for b in (q.codes, q.d, q.m))
        assert 8 * held / (O * I) == bits, (arithmetic, 8 * held / (O * I))


# ---- kind 12: Q5_0's and Q5_1's 5-bit codes (nibbles and a plane of high bits) ------------------------
def q5_raw(kind_name: str, O: int, I: int, seed: int, top: bool = False) -> np.ndarray:
    """Q5_0/Q5_1 bytes with random codes and float16 scales of either sign from subnormal (2^-24) to ~6
    (Q5_1's mins likewise); top: every code 31, every scale positive (the int8 sums' largest)."""
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (O * I // 32, BLOCK_BYTES[kind_name]), dtype=np.uint8)
    n, k = raw.shape[0], 2 if kind_name == "Q5_1" else 1
    v = g.choice([-1.0, 1.0], (n, k)) * 2.0 ** g.integers(-24, 3, (n, k)) * (1 + g.random((n, k)))
    v[g.random((n, k)) < 0.05] = 0.0
    if top:
        v, raw[:, 2 * k:] = np.abs(v) + 0.5, 0xFF
    raw[:, :2 * k] = v.astype(np.float16).view(np.uint8).reshape(n, 2 * k)
    return raw.reshape(O, -1)


def qlinear_of(blocks, bias, I: int, O: int, kernel_dir, isa: str, arithmetic: str) -> QLinear:
    return QLinear(blocks[0], *(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in blocks[1:]),
                   bias, I, O, kernel_dir, isa, arithmetic)


def test_q5_codes_are_the_files_bytes_and_round_trip():
    raw = q5_raw("Q5_1", 3, 64, seed=1)
    kind, codes, d, m = decode("Q5_1", raw, 3, 64)
    assert kind == 12 and codes.shape == (3, 40) and np.array_equal(codes[:, :20], raw[:, 4:24])
    q = q5_values(torch.from_numpy(codes))
    assert q.shape == (3, 2, 32) and int(q.max()) <= 31 and torch.equal(q5_codes(q), torch.from_numpy(codes))
    assert np.array_equal(widen((kind, codes, d, m))[1], q.reshape(3, 64).numpy())


def test_q5_i8_plane_worked_example():
    """pack_q5_i8's docstring: output 0's block holds 16..31 then 0..15 (the others all 0): "lanes" plane
    bytes 0..3 are 0x33, "masks" bytes 0, 8, 16, 24 are 0x0F (output 0's four lo / hi bytes)."""
    q = torch.zeros(16, 1, 32, dtype=torch.uint8)
    q[0, 0] = torch.cat([torch.arange(16, 32), torch.arange(16)])
    codes, _, _ = pack_q5_i8(q5_codes(q), torch.ones(16, 1), torch.zeros(16, 1), "lanes")
    assert codes.shape == (1, 1, 320) and list(codes[0, 0, 256:260]) == [0x33] * 4
    assert int(codes[0, 0, 260:].sum()) == 0
    masks = pack_q5_i8(q5_codes(q), torch.ones(16, 1), torch.zeros(16, 1), "bytes")[0][0, 0, 256:]
    assert [i for i in range(64) if masks[i]] == [0, 8, 16, 24] and list(masks[[0, 8, 16, 24]]) == [0x0F] * 4
    assert torch.equal(masks, pack_q5_i8(q5_codes(q), torch.ones(16, 1), torch.zeros(16, 1))[0][0, 0, 256:])
    assert list(codes[0, 0, :4]) == [0x40, 0x51, 0x62, 0x73]  # pack_q4_i8's nibbles: codes 0..7's low bits


@needs_kernel
@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
@pytest.mark.parametrize("isa", isa_params())
def test_q4_0_and_q5_0_without_a_min_give_the_bits_of_their_min_held(isa, arithmetic, kernel_dir):
    """A file's Q4_0 and Q5_0 blocks are held without a min (m None: the kernels form -8 d / -16 d from d,
    csrc/qlinear.h v_min_of); against the same blocks with that min held as float16 values (as they were
    before): the same bits for 1..19 rows and 80/91, both arithmetics, every build. Scales up to 2^2 and
    one of 8192, whose -16 d (-131072) is no float16 value (such a file was refused while the min was held)."""
    x = wide_range_x(91, 320, seed=14) if arithmetic == "exact" else activations(91, 320, seed=14)
    for kind_name, O, seed in (("Q4_0", 37, 5), ("Q5_0", 21, 6)):
        raw = q5_raw("Q5_0", O, 320, seed) if kind_name == "Q5_0" else \
            raw_of("Q4_0", rows(O, 320, seed))
        blocks = decode(kind_name, raw, O, 320)
        assert blocks[3] is None and blocks[0] == (12 if kind_name == "Q5_0" else 4)
        held = implied_min(blocks)
        assert np.array_equal(held[3], (-16.0 if kind_name == "Q5_0" else -8.0) * blocks[2])
        bias = torch.randn(O, generator=torch.Generator().manual_seed(seed))
        q0, q1 = (qlinear_of(b, bias, 320, O, kernel_dir, isa, arithmetic) for b in (blocks, held))
        assert q0.m.numel() == 0 and q1.m.numel() > 0
        for n in (*range(1, 20), 80, 91):
            assert torch.equal(q0(x[:n]), q1(x[:n])), f"{isa} {arithmetic} {kind_name} differs at n = {n}"
    big = q5_raw("Q5_0", 1, 32, seed=2)
    big[0, :2] = np.array([8192.0], np.float16).view(np.uint8)
    blocks = decode("Q5_0", big, 1, 32)
    y = qlinear_of(blocks, None, 32, 1, kernel_dir, isa, arithmetic)(x[:3, :32])
    ref = reference_i8(blocks, None, x[:3, :32]) if arithmetic == "int8" else reference_linear(rebuild(blocks), x[:3, :32], None)
    assert torch.equal(y, ref) and torch.isfinite(y).all()


@needs_kernel
@pytest.mark.parametrize("arithmetic", ["exact", "int8"])
@pytest.mark.parametrize("isa", isa_params())
def test_kind_12_gives_kind_9s_bits(isa, arithmetic, kernel_dir):
    """Kind 12 (5-bit codes, float16 d and m) against kind 9 holding the same weights (8-bit codes,
    float32 d and m) in the same arithmetic: the same bits for 1..19 rows (one row, narrow and wide tiles)
    and 80/91 rows (rebuilt panels), ragged panels, biases, subnormal scales; and every code 31 against
    activations all +127 (without VNNI the int16 sums would overflow unless widened every two chunks)."""
    x = wide_range_x(91, 320, seed=12) if arithmetic == "exact" else activations(91, 320, seed=12)
    top = torch.ones(19, 320) * 0.5
    for kind_name, O, seed, full in (("Q5_0", 37, 1, False), ("Q5_1", 40, 2, False), ("Q5_1", 16, 3, True),
                                     ("Q5_0", 21, 4, True)):
        blocks = decode(kind_name, q5_raw(kind_name, O, 320, seed, full), O, 320)
        bias = torch.randn(O, generator=torch.Generator().manual_seed(seed)) if seed % 2 else None
        q5, q8 = (qlinear_of(b, bias, 320, O, kernel_dir, isa, arithmetic) for b in (blocks, widen(blocks)))
        assert (q5.kind, q8.kind) == (12, 9)
        for n in (*range(1, 20), 80, 91):
            y = q5(x[:n])
            assert torch.equal(y, q8(x[:n])), f"{isa} {arithmetic} {kind_name} O={O} differs at n = {n}"
            assert not y.isnan().any()
        if full:
            y = q5(top)
            assert torch.equal(y, q8(top)) and torch.equal(y, reference_i8(blocks, bias, top) if arithmetic == "int8"
                                                          else reference_linear(rebuild(blocks), top, bias))


@needs_kernel
@pytest.mark.parametrize("isa", isa_params())
def test_kind_12_gives_q5_0s_old_kind_8_bits_in_the_exact_arithmetic(isa, kernel_dir):
    """Q5_0 as kind 12 (q * d + m, m = -16 d) and as kind 8 (codes q - 16, no min): the same weights
    (but ggml's -0.0, +0.0 here), one fma chain each in the same order: the same bits."""
    O, I = 35, 256
    blocks = decode("Q5_0", raw_of("Q5_0", rows(O, I, 3)), O, I)
    q = q5_values(torch.from_numpy(blocks[1])).to(torch.int8) - 16
    old = (8, q.reshape(O, I).view(torch.uint8).numpy(), blocks[2], None)
    x = wide_range_x(91, I, seed=5)
    q12, q8 = (qlinear_of(b, None, I, O, kernel_dir, isa, "exact") for b in (blocks, old))
    for n in (*range(1, 20), 80, 91):
        assert torch.equal(q12(x[:n]), q8(x[:n])), f"{isa} differs at n = {n}"


def test_q5_and_q4_0_hold_the_files_bytes_per_weight(kernel_dir):
    """Codes and float16 scales as the file holds them, in both layouts: Q5_0 5 + 16/32 = 5.5 bits per weight
    (its min implied), Q5_1 6 (d and m), Q4_0 4.5, Q4_1 5 (Q5_0 as kind 8 held 8.5, as kind 12 with its min
    6; Q5_1 as kind 9 10; Q4_0 with its min 5)."""
    O, I = 64, 1024
    for kind_name, bits in (("Q5_0", 5.5), ("Q5_1", 6.0), ("Q4_0", 4.5), ("Q4_1", 5.0)):
        blocks = decode(kind_name, raw_of(kind_name, rows(O, I, 5)), O, I)
        for arithmetic in ("exact", "int8"):
            q = qlinear_of(blocks, None, I, O, kernel_dir, "scalar", arithmetic)
            held = sum(b.numel() * b.element_size() for b in (q.codes, q.d, q.m))
            assert 8 * held / (O * I) == bits, (kind_name, arithmetic, 8 * held / (O * I))
