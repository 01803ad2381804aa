"""Exact compressed kernels: recovery of block-quantised weights, and the C kernel in its three ISA
variants (AVX-512, AVX2, scalar), which must give the same bits as each other and as an exact
float32 reference of the written-out op order (csrc/qlinear.c)."""

import numpy as np
import pytest
import torch
from torch import nn

from trserve.engine.model.kernels import build, pack
from trserve.engine.model.kernels.build import ISAS, available_isas, kernel_isa, qlinear_supported
from trserve.engine.model.kernels.qlinear import QLinear, quantize_linears
from trserve.engine.model.kernels.recover import recover_q4, recover_q8

# Any x86-64 Linux host with gcc runs the kernels (scalar at least); a variant's own tests skip only
# where the CPU lacks its instructions (avx512 on most, avx2 on pre-2013 CPUs).
KERNELS_RUN = qlinear_supported() and build._compiler() is not None
needs_kernel = pytest.mark.skipif(not KERNELS_RUN, reason="needs x86-64 Linux and a C compiler")


def isa_params():
    """One pytest param per variant, skipped where this CPU cannot run it."""
    runs = available_isas()
    return [pytest.param(isa, marks=pytest.mark.skipif(isa not in runs, reason=f"CPU cannot run {isa}"))
            for isa in ISAS]


def q4_weights(out_f: int, in_f: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """[out_f, in_f] float32 weights that are exactly Q4_1 blocks (q * d + m, q in 0..15, fp16 d, m)."""
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    q = torch.randint(0, 16, (out_f, nb, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # as in GGUF: the block's min is q = 0 and its max q = 15
    d = (torch.rand(out_f, nb, generator=g) * scale + 1e-4).half().float()
    m = (-7.5 * d * (0.5 + torch.rand(out_f, nb, generator=g))).half().float()
    return (q * d[..., None] + m[..., None]).reshape(out_f, in_f)


def q4_0_weights(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """[out_f, in_f] float32 weights as a Q4_0 file holds them: gguf-py's Q4_0 quantization of random
    weights, dequantized as ggml does ((q - 8) * d; d negative where a block's largest value is positive)."""
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(seed).standard_normal((out_f, in_f)).astype(np.float32) * 0.02
    blocks = quants.quantize(x, GGMLQuantizationType.Q4_0)
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q4_0).astype(np.float32))


def q5_0_weights(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    """The same for Q5_0 ((q - 16) * d): exactly the kernels' 8-bit blocks, codes -16..15."""
    from gguf import GGMLQuantizationType, quants

    x = np.random.default_rng(seed).standard_normal((out_f, in_f)).astype(np.float32) * 0.02
    blocks = quants.quantize(x, GGMLQuantizationType.Q5_0)
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType.Q5_0).astype(np.float32))


def q8_weights(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    q = torch.randint(-127, 128, (out_f, nb, 32), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(out_f, nb, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d[..., None]).reshape(out_f, in_f)


def wide_range_q4_weights(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    """Q4_1 blocks whose fp16 scales span subnormal (< 6.1e-5) to large, so the half -> float
    conversions of every variant (the portable one included) see all kinds of finite halves."""
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    q = torch.randint(0, 16, (out_f, nb, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (2.0 ** torch.randint(-22, 2, (out_f, nb), generator=g).float() * (1 + torch.rand(out_f, nb, generator=g)))
    d = d.half().float()
    m = (-7.5 * d * (0.5 + torch.rand(out_f, nb, generator=g))).half().float()
    return (q * d[..., None] + m[..., None]).reshape(out_f, in_f)


def wide_range_x(n: int, in_f: int, seed: int) -> torch.Tensor:
    """[n, in_f] inputs with magnitudes over 2^-8 .. 2^8, so partial sums round often and a change of
    op order would show in the bits."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, in_f, generator=g) * 2.0 ** torch.randint(-8, 9, (n, in_f), generator=g).float()


# ---- an exact reference of the kernels' op order (pure torch) ---------------------------------------
def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 fma(a, b, c), elementwise, float32 in and out.

    float64(a) * float64(b) is exact (24 + 24 significant bits <= 53). Rounding a * b + c to float64
    and then to float32 could round twice the wrong way, so instead: TwoSum gives s + e == a*b + c
    exactly; rounding that to *odd* in float64 (s, or its neighbour towards e when inexact and s's
    last bit is even) and then to nearest float32 is the correctly rounded result, since float64
    carries more than 24 + 2 bits (Boldo & Melquiond, round-to-odd)."""
    p, c64 = a.double() * b.double(), c.double()
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)  # TwoSum: exact error of s
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(e > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where((e != 0) & even, torch.nextafter(s, toward), s).float()


def reference_linear(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, fma=fma32) -> torch.Tensor:
    """w: [O, I], x: [n, I] float32 -> [n, O]: every output as csrc/qlinear.c computes it, op by op:
    one chain per output over the inputs in order, acc = fma(w[o, i], x[i], acc), then + bias."""
    n, in_f = x.shape
    acc = torch.zeros(n, w.shape[0])  # [n, O]
    for i in range(in_f):
        acc = fma(w[None, :, i].expand(n, -1), x[:, i, None].expand_as(acc), acc)
    return acc + bias if bias is not None else acc


def test_fma32_rounds_once():
    one_up, one_down = 1 + 2.0**-23, 1 - 2.0**-23
    a, b = torch.tensor([one_up, 3.0, 1e-3]), torch.tensor([one_down, 1 / 3, 7.0])
    c = torch.tensor([-1.0, -1.0, 0.0])
    got = fma32(a, b, c)
    assert got[0].item() == -(2.0**-46)  # unfused: a * b rounds to 1.0 and the sum to 0
    assert (a * b + c)[0].item() == 0.0
    assert got[1].item() == (torch.tensor(3.0).double() * torch.tensor(1 / 3).double() - 1).float().item()
    assert got[2].item() == (a[2] * b[2]).item()  # + 0: a single rounding of the product


def test_reference_bits_depend_on_the_op_order():
    """The bit-for-bit tests below have teeth: unfused multiply-adds, or a stock matmul, differ."""
    w, x = q4_weights(12, 576, seed=1), wide_range_x(19, 576, seed=2)
    ref = reference_linear(w, x, None)
    unfused = reference_linear(w, x, None, fma=lambda a, b, c: a * b + c)
    assert not torch.equal(ref, unfused) and not torch.equal(ref, x @ w.T)
    torch.testing.assert_close(ref, x @ w.T, atol=1e-3, rtol=1e-4)


# ---- recovery -------------------------------------------------------------------------------
def test_recover_q4_is_bit_exact_and_packs_nibbles():
    w = q4_weights(6, 64)
    codes, d, m = recover_q4(w)
    assert codes.shape == (6, 32) and codes.dtype == torch.uint8 and d.shape == m.shape == (6, 2)
    per_block = codes.reshape(6, 2, 16)  # byte j of a block: q_j low nibble, q_{j+16} high nibble
    q = torch.cat([per_block & 0xF, per_block >> 4], dim=-1).float()  # [6, 2, 32]
    assert torch.equal(q * d[..., None] + m[..., None], w.reshape(6, 2, 32))  # bit for bit


def test_recover_q4_takes_q4_0_blocks_exactly():
    """Issue 55: a Q4_0 block is q * d + m with m = -8 d: recovered exactly, negative scales included,
    and a tensor mixing Q4_0 and Q4_1 blocks too."""
    w = q4_0_weights(8, 256, seed=2)
    codes, d, m = recover_q4(w)
    assert (d < 0).any() and (d > 0).any() and torch.equal(m, -8 * d)
    q = torch.cat([codes.reshape(8, 8, 16) & 15, codes.reshape(8, 8, 16) >> 4], -1).float()
    assert torch.equal((q * d[..., None] + m[..., None]).reshape(8, 256), w)
    mixed = torch.cat([w[:, :128], q4_weights(8, 128, seed=3)], 1)
    codes, d, m = recover_q4(mixed)
    q = torch.cat([codes.reshape(8, 8, 16) & 15, codes.reshape(8, 8, 16) >> 4], -1).float()
    assert torch.equal((q * d[..., None] + m[..., None]).reshape(8, 256), mixed)


def test_recover_q8_takes_q5_0_blocks_exactly():
    w = q5_0_weights(8, 256, seed=4)
    codes, d = recover_q8(w)
    assert (d < 0).any() and codes.min() >= -16 and codes.max() <= 15
    assert torch.equal((codes.float().reshape(8, 8, 32) * d[..., None]).reshape(8, 256), w)
    mixed = torch.cat([w[:, :128], q8_weights(8, 128, seed=3)], 1)
    codes, d = recover_q8(mixed)
    assert torch.equal((codes.float().reshape(8, 8, 32) * d[..., None]).reshape(8, 256), mixed)


def test_recover_rejects_weights_that_are_not_blocks():
    w = torch.randn(4, 64)
    assert recover_q4(w) is None and recover_q8(w) is None
    assert recover_q4(torch.randn(4, 40)) is None  # not a multiple of 32
    almost = q4_weights(4, 64)
    almost[2, 5] = torch.nextafter(almost[2, 5], torch.tensor(1.0))  # one ulp off in one weight
    assert recover_q4(almost) is None


def test_recover_q8_is_bit_exact():
    w = q8_weights(4, 96)
    codes, d = recover_q8(w)
    assert codes.dtype == torch.int8 and d.shape == (4, 3)
    assert torch.equal(codes.float().reshape(4, 3, 32) * d[..., None], w.reshape(4, 3, 32))


# ---- ISA selection -------------------------------------------------------------------------------
def test_isa_names_and_resolution():
    with pytest.raises(ValueError):
        kernel_isa("sse9")
    runs = available_isas()
    if runs:  # x86-64 Linux: best first, scalar always there
        assert runs[-1] == "scalar" and kernel_isa() == runs[0] and kernel_isa("scalar") == "scalar"
        assert runs == [isa for isa in ISAS if isa in runs]
    for isa in set(ISAS) - set(runs):
        with pytest.raises(RuntimeError):
            kernel_isa(isa)


# ---- the kernels ---------------------------------------------------------------------------------

CASES = {  # name: (weights, bias); outputs of one partial panel, several panels with a partial last one (so
    # multi-panel tiles, single-panel tails and the threads' split), and an odd count
    "q4-bias": (lambda: q4_weights(10, 96, seed=3), True),
    "q4-panels-bias": (lambda: q4_weights(72, 576, seed=13), True),
    "q8-panels": (lambda: q8_weights(37, 128, seed=14), False),
    "q4-odd": (lambda: q4_weights(5, 64, seed=15), False),
    "q4": (lambda: wide_range_q4_weights(6, 576, seed=4), False),
    "q8": (lambda: q8_weights(10, 96, seed=5), False),
    "q8-bias-576": (lambda: q8_weights(4, 576, seed=6), True),
    "q4_0-panels-bias": (lambda: q4_0_weights(40, 576, seed=16), True),  # issue 55: Q4_0 files' blocks
    "q5_0-panels": (lambda: q5_0_weights(24, 576, seed=17), False),  # and Q5_0's, as 8-bit blocks
}


def compressed(case: str, isa: str, kernel_dir, arithmetic: str = "exact") -> tuple[nn.Linear, QLinear]:
    make, bias = CASES[case]
    w = make()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(torch.randn(w.shape[0], generator=torch.Generator().manual_seed(9)) * 0.1)
    holder = nn.Sequential(lin)
    assert quantize_linears(holder, kernel_dir, isa, arithmetic) == (1, 0)
    assert isinstance(holder[0], QLinear) and holder[0].isa == kernel_isa(isa) and holder[0].arithmetic == arithmetic
    return lin, holder[0]


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("isa", isa_params())
def test_kernel_equals_exact_reference_for_every_width(isa, case, kernel_dir):
    """Every output bit equals the reference's, for n = 1..19 rows (one row, register tiles, rebuilt
    panels with full and ragged row tiles), for single rows anywhere and for slices: so each variant is row-invariant (a row
    gives the same bits alone or in a tree batch) and all variants are bit-identical."""
    lin, q = compressed(case, isa, kernel_dir)
    x = wide_range_x(19, lin.in_features, seed=7)
    with torch.no_grad():
        ref = reference_linear(lin.weight, x, lin.bias)
        torch.testing.assert_close(ref, lin(x), atol=1e-3, rtol=1e-4)  # the reference is a linear layer
    for n in range(1, 20):
        assert torch.equal(q(x[:n]), ref[:n]), f"{isa} differs from the reference at n = {n}"
    for i in range(19):
        assert torch.equal(q(x[i : i + 1]), ref[i : i + 1])
    assert torch.equal(q(x[5:16]), ref[5:16])
    assert torch.equal(q(x[None, 2:9])[0], ref[2:9])  # leading dims kept


@needs_kernel
@pytest.mark.parametrize("case", ["q4-panels-bias", "q8-panels", "q4"])
@pytest.mark.parametrize("isa", isa_params())
def test_wide_batches_rebuild_panels_once_with_the_same_bits(isa, case, kernel_dir):
    """From 80 rows (prefill chunks) the kernel rebuilds each panel group once into a buffer and
    reads it from every row tile (csrc/qlinear.c, deq_part): still the reference's bits, for full
    and ragged row tiles and for panel pairs and a single tail panel."""
    lin, q = compressed(case, isa, kernel_dir)
    x = wide_range_x(131, lin.in_features, seed=17)
    with torch.no_grad():
        ref = reference_linear(lin.weight, x, lin.bias)
    for n in (80, 91, 131):
        assert torch.equal(q(x[:n]), ref[:n]), f"{isa} differs from the reference at n = {n}"


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
def test_all_variants_give_the_same_bits(case, kernel_dir):
    """The runnable variants against each other directly (also where one of them is missing)."""
    x = wide_range_x(19, compressed(case, "scalar", kernel_dir)[0].in_features, seed=8)
    outs = {isa: compressed(case, isa, kernel_dir)[1](x) for isa in available_isas()}
    assert {"avx2", "scalar"} <= set(outs) or outs.keys() == {"scalar"}
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), f"{isa} != scalar"


@needs_kernel
def test_scales_are_stored_as_float16(kernel_dir):
    _, q = compressed("q4-bias", kernel_isa(), kernel_dir)  # 10 outputs: one panel of 16, 6 of them padding
    assert q.d.dtype == q.m.dtype == torch.float16 and q.d.shape == q.m.shape == (1, 3, 16)
    stored = q.codes.numel() + 2 * (q.d.numel() + q.m.numel())
    assert stored / (16 * 96) == 0.625  # Q4: bytes per weight
    assert kernel_isa() in repr(q)


def test_panel_packing_places_every_code_and_scale():
    """pack_q4 / pack_q8 against the layout csrc/qlinear.c documents, element by element."""
    w4, w8 = q4_weights(20, 64, seed=11), q8_weights(20, 64, seed=12)
    codes, d, m = recover_q4(w4)
    pc, pd, pm = pack.pack_q4(codes, d.half(), m.half())
    assert pc.shape == (2, 2, 16, 16) and pd.shape == pm.shape == (2, 2, 16)
    per_block = codes.reshape(20, 2, 16)
    q = torch.cat([per_block & 0xF, per_block >> 4], dim=-1)  # [O, nb, 32]
    for o, b, j in [(0, 0, 0), (5, 1, 7), (17, 0, 15), (19, 1, 3)]:
        p, lane = divmod(o, 16)
        assert pc[p, b, j, lane] == q[o, b, 2 * j] | (q[o, b, 2 * j + 1] << 4)
        assert pd[p, b, lane] == d[o, b].half() and pm[p, b, lane] == m[o, b].half()
    assert not pc[1, :, :, 4:].any() and not pd[1, :, 4:].any()  # outputs 20..31: padding, weight 0
    lc, ld, lm = pack.pack_q4(codes, d.half(), m.half(), "lanes")
    assert torch.equal(ld, pd) and torch.equal(lm, pm) and lc.shape == pc.shape
    words = lc.reshape(2, 2, 64, 4).to(torch.int64)  # [P, nb, 16 g + l, byte]: little-endian uint32
    words = (words << (8 * torch.arange(4))).sum(-1).reshape(2, 2, 4, 16)  # [P, nb, g, l]
    for o, b, i in [(0, 0, 0), (5, 1, 7), (17, 0, 31), (19, 1, 12), (3, 0, 25)]:
        p, lane = divmod(o, 16)
        g, k = divmod(i, 8)
        assert (words[p, b, g, lane] >> (4 * k)) & 0xF == q[o, b, i]
    assert not words[1, :, :, 4:].any()
    with pytest.raises(ValueError):
        pack.pack_q4(codes, d.half(), m.half(), "columns")
    c8, d8 = recover_q8(w8)
    qc, qd = pack.pack_q8(c8.view(torch.uint8), d8.half())
    assert qc.shape == (2, 2, 32, 16) and qd.shape == (2, 2, 16)
    for o, b, j in [(0, 0, 0), (9, 1, 31), (18, 0, 17)]:
        p, lane = divmod(o, 16)
        assert qc[p, b, j, lane] == c8.view(torch.uint8)[o, 32 * b + j] and qd[p, b, lane] == d8[o, b].half()


@needs_kernel
def test_qlinear_rejects_scales_that_are_not_float16(kernel_dir):
    codes, d, m = recover_q4(q4_weights(2, 32))
    with pytest.raises(ValueError):
        QLinear(4, codes, d + 1e-6, m, None, 32, 2, kernel_dir)
    with pytest.raises(ValueError):
        QLinear(4, codes, d, m, None, 32, 3, kernel_dir)  # codes for 2 outputs, 3 declared


@needs_kernel
def test_quantize_linears_keeps_layers_that_do_not_recover(kernel_dir):
    net = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 64))  # random weights, and I = 8
    assert quantize_linears(net, kernel_dir) == (0, 2)
    assert all(isinstance(m, nn.Linear) for m in net)


@needs_kernel
def test_loader_prefers_packed_over_scalar_under_auto(monkeypatch, tmp_path):
    """Under auto a CPU that only runs the scalar variant gets oneDNN kernels (faster); asking for
    compressed kernels still gets them, on scalar."""
    from trserve.engine.model.loader import ModelConfig, _compress

    monkeypatch.setattr(build, "available_isas", lambda: ["scalar"])
    make = lambda: nn.Sequential(nn.Linear(64, 8))  # noqa: E731
    net = make()
    with torch.no_grad():
        net[0].weight.copy_(q4_weights(8, 64))
    assert _compress(net, ModelConfig(kernels="auto", cache_dir=str(tmp_path))) is None
    assert isinstance(net[0], nn.Linear)
    assert _compress(net, ModelConfig(kernels="compressed", cache_dir=str(tmp_path))) == "scalar"
    assert isinstance(net[0], QLinear) and net[0].isa == "scalar"


@needs_kernel
@pytest.mark.slow
def test_builtin_model_runs_entirely_on_compressed_kernels(loaded_smollm2, hf_reference):
    """Every linear layer of the builtin model recovers exactly; logits stay within float noise of stock."""
    assert loaded_smollm2.kernels == "compressed" and loaded_smollm2.isa == kernel_isa()
    assert not any(isinstance(m, nn.Linear) for m in loaded_smollm2.model.modules())
    ids = torch.tensor([loaded_smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")])
    with torch.inference_mode():
        a = loaded_smollm2.model(input_ids=ids).logits
        b = hf_reference.model(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_kernel_libraries_are_built_once_per_variant_and_loadable_by_other_users(kernel_dir):
    from trserve.engine.model.kernels.build import build_kernels

    libs = {isa: build_kernels(kernel_dir, isa) for isa in ISAS}  # any variant builds on any x86-64 host
    assert len(set(libs.values())) == len(ISAS)
    for isa, lib in libs.items():
        assert lib.parent == kernel_dir / "kernels" and isa in lib.name
        assert lib.stat().st_mode & 0o055 == 0o055  # group/others: r-x
    mtime = libs["scalar"].stat().st_mtime_ns
    assert build_kernels(kernel_dir, "scalar") == libs["scalar"] and libs["scalar"].stat().st_mtime_ns == mtime
    assert build_kernels(kernel_dir) == libs[kernel_isa()]  # auto: this CPU's best


def test_kernel_bench_weights_recover_as_blocks():
    """bench/qlinear_isa.py times the compressed kernels on its own block weights: they must recover
    (it once timed oneDNN's nn.Linear under every kernel's name because they did not)."""
    from trserve.bench.qlinear_isa import block_weights

    assert recover_q4(block_weights("q4", 64, 96)) is not None
    assert recover_q8(block_weights("q8", 64, 96)) is not None


@needs_kernel
def test_kernels_called_from_many_threads_and_a_forked_child_give_the_same_bits(kernel_dir):
    """The kernels' own thread pool (csrc/pool.h) serves whichever thread calls, one run at a time:
    four Python threads calling at once, with 1 to 4 kernel threads each, all get the reference's
    bits and none hangs; a forked child (which has none of the parent's workers) starts its own."""
    import multiprocessing
    import os
    import threading

    from trserve.engine.model.kernels.build import _library

    lin, q = compressed("q4-panels-bias", kernel_isa("auto"), kernel_dir)
    x = wide_range_x(11, lin.in_features, seed=21)
    with torch.no_grad():
        ref = reference_linear(lin.weight, x, lin.bias)
    fn = _library(kernel_dir, q.isa)

    def call(n_rows: int, threads: int) -> torch.Tensor:
        y = torch.empty(n_rows, q.out_features)
        m = q.m.data_ptr() if q.kind == 4 else None
        bias = q.bias.data_ptr() if q.bias is not None else None
        assert fn(q.kind, x.data_ptr(), n_rows, q.in_features, q.out_features, q.codes.data_ptr(), q.d.data_ptr(),
                  m, bias, y.data_ptr(), threads) == 0
        return y

    bad: list[str] = []

    def worker(t: int) -> None:
        for i in range(40):
            n, threads = 1 + (i + t) % 11, 1 + (i * 7 + t) % 4
            if not torch.equal(call(n, threads), ref[:n]):
                bad.append(f"thread {t} call {i}: {n} rows on {threads} threads")

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in pool:
        th.start()
    for th in pool:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in pool), "a kernel call hung"
    assert not bad, bad[:3]

    def child_main() -> None:
        os._exit(0 if torch.equal(call(11, 2), ref) else 3)

    child = multiprocessing.get_context("fork").Process(target=child_main)
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, f"forked child exit code {child.exitcode}"


def test_units_compile_side_by_side_then_link_into_one_library(tmp_path):
    """build_kernels compiles each unit on its own, at once, then links them: a library whose units call
    each other loads and runs; a unit that does not compile is the result returned (its error)."""
    import ctypes

    from trserve.engine.model.kernels.build import _compile_and_link, _compiler

    if _compiler() is None:
        pytest.skip("no C compiler")
    (tmp_path / "a.c").write_text("int f(void) { return 41; }\n")
    (tmp_path / "b.c").write_text("int f(void);\nint g(void) { return f() + 1; }\n")
    (tmp_path / "bad.c").write_text("int h(void) { return undefined_name; }\n")
    out = tmp_path / "lib.so"
    assert _compile_and_link("scalar", [tmp_path / "a.c", tmp_path / "b.c"], str(out)).returncode == 0
    assert ctypes.CDLL(str(out)).g() == 42
    failed = _compile_and_link("scalar", [tmp_path / "a.c", tmp_path / "bad.c"], str(tmp_path / "no.so"))
    assert failed.returncode != 0 and "undefined_name" in failed.stderr
