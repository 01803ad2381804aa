"""Exact compressed kernels: recovery of block-quantised weights, and the AVX-512 kernel itself."""

import pytest
import torch
from torch import nn

from engine.model.qlinear import QLinear, qlinear_supported, quantize_linears, recover_q4, recover_q8

needs_kernel = pytest.mark.skipif(not qlinear_supported(), reason="needs x86-64 AVX-512 and a C compiler")


def q4_weights(out_f: int, in_f: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """[out_f, in_f] float32 weights that are exactly Q4_1 blocks (q * d + m, q in 0..15, fp16 d, m)."""
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    q = torch.randint(0, 16, (out_f, nb, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # as in GGUF: the block's min is q = 0 and its max q = 15
    d = (torch.rand(out_f, nb, generator=g) * scale + 1e-4).half().float()
    m = (-7.5 * d * (0.5 + torch.rand(out_f, nb, generator=g))).half().float()
    return (q * d[..., None] + m[..., None]).reshape(out_f, in_f)


def q8_weights(out_f: int, in_f: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    q = torch.randint(-127, 128, (out_f, nb, 32), generator=g).float()
    q[..., 0] = 127
    d = (torch.rand(out_f, nb, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d[..., None]).reshape(out_f, in_f)


def test_recover_q4_is_bit_exact_and_packs_nibbles():
    w = q4_weights(6, 64)
    codes, d, m = recover_q4(w)
    assert codes.shape == (6, 32) and codes.dtype == torch.uint8 and d.shape == m.shape == (6, 2)
    per_block = codes.reshape(6, 2, 16)  # byte j of a block: q_j low nibble, q_{j+16} high nibble
    q = torch.cat([per_block & 0xF, per_block >> 4], dim=-1).float()  # [6, 2, 32]
    assert torch.equal(q * d[..., None] + m[..., None], w.reshape(6, 2, 32))  # bit for bit


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


@needs_kernel
@pytest.mark.parametrize("make, bias", [(q4_weights, True), (q4_weights, False), (q8_weights, False)])
def test_kernel_matches_linear_and_is_row_invariant(make, bias, tmp_path):
    lin = nn.Linear(96, 10, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(make(10, 96, seed=3))
    x = torch.randn(19, 96)  # tiles of 8 + 8 + 3 rows
    ref = lin(x)
    holder = nn.Sequential(lin)
    assert quantize_linears(holder, tmp_path) == (1, 0)
    q = holder[0]
    assert isinstance(q, QLinear)
    y = q(x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    # the same row gives the same bits alone, in any tile position and batch width: tree == plain
    for i in range(19):
        assert torch.equal(q(x[i : i + 1]), y[i : i + 1])
    assert torch.equal(q(x[5:16]), y[5:16])
    assert torch.equal(q(x[None, 2:9])[0], y[2:9])  # leading dims kept


@needs_kernel
def test_quantize_linears_keeps_layers_that_do_not_recover(tmp_path):
    net = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 64))  # random weights, and I = 8
    assert quantize_linears(net, tmp_path) == (0, 2)
    assert all(isinstance(m, nn.Linear) for m in net)


@needs_kernel
@pytest.mark.slow
def test_builtin_model_runs_entirely_on_compressed_kernels(loaded_smollm2, hf_reference):
    """Every linear layer of the builtin model recovers exactly; logits stay within float noise of stock."""
    assert loaded_smollm2.kernels == "compressed"
    assert not any(isinstance(m, nn.Linear) for m in loaded_smollm2.model.modules())
    ids = torch.tensor([loaded_smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")])
    with torch.inference_mode():
        a = loaded_smollm2.model(input_ids=ids).logits
        b = hf_reference.model(input_ids=ids).logits
    assert (a - b).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_kernel
def test_kernel_library_is_built_once_and_loadable_by_other_users(tmp_path):
    from engine.model.qlinear import build_kernels

    lib = build_kernels(tmp_path)
    assert lib.parent == tmp_path / "kernels" and lib.stat().st_mode & 0o055 == 0o055  # group/others: r-x
    mtime = lib.stat().st_mtime_ns
    assert build_kernels(tmp_path) == lib and lib.stat().st_mtime_ns == mtime  # cached, not rebuilt
