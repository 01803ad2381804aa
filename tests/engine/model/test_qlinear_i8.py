"""The int8 arithmetic (csrc/qlinear_i8.c): activations quantized per block of 32, integer dot products
with the 4/8-bit codes, the float part in one fixed order. Every variant gives the bits of a torch
reference of that order, for every width and every row alone, so the variants equal each other; the
native forward on it keeps a token's logits independent of the batch (TR == AR bit for bit: test_native.py)."""

import ctypes

import pytest
import torch
from torch import nn

from trserve.engine.model.kernels import build
from trserve.engine.model.kernels.build import available_isas, kernel_isa
from trserve.engine.model.kernels.pack import pack_q4_i8, pack_q8_i8
from trserve.engine.model.kernels.qlinear import QLinear
from trserve.engine.model.kernels.recover import recover_q4, recover_q8
from tests.engine.model.test_qlinear import (CASES, compressed, fma32, isa_params, needs_kernel, q4_weights, q8_weights,
                                             wide_range_x)


# ---- a reference of the int8 arithmetic's op order (pure torch) ----------------------------------
def reference_quant(x: torch.Tensor):
    """x [n, I] -> (q [n, nb, 32] int64, s [n, nb], c [n, nb] int64), as csrc/qlinear_i8.c quantizes."""
    n, in_f = x.shape
    blk = x.reshape(n, in_f // 32, 32)
    amax = blk.abs().amax(-1)  # [n, nb]
    inv = torch.tensor(127.0) / amax  # float32 division, as the kernel's
    ok = (amax > 0) & torch.isfinite(inv)
    q = torch.round(blk * torch.where(ok, inv, 0)[..., None]).clamp(-127, 127)  # round half to even
    q = torch.where(ok[..., None], q, 0).to(torch.int64)
    s = torch.where(ok, amax / torch.tensor(127.0), 0)
    return q, s, q.sum(-1)


def reference_i8_linear(lin: nn.Linear, x: torch.Tensor, kept: list[int] = ()) -> torch.Tensor:
    """[n, O]: per output, acc = fma(float(isum_b) * s_b, d_b, acc) (q4: then acc = fma(m_b, c_b * s_b, acc))
    over the blocks in order, then + bias; isum the exact integer dot product of codes and q. `kept`
    inputs are quantized as zeros and added last: acc = fma(W[o, j], x[j], acc) for j in order."""
    w = lin.weight.detach()
    xs = x[:, list(kept)].clone()
    x = x.clone()
    x[:, list(kept)] = 0.0
    out_f, in_f = w.shape
    nb = in_f // 32
    q4 = recover_q4(w)
    if q4 is not None:
        codes, d, m = q4
        blk = codes.reshape(out_f, nb, 16).to(torch.int64)
        wq = torch.cat([blk & 0xF, blk >> 4], dim=-1)  # [O, nb, 32]
    else:
        codes, d = recover_q8(w)
        wq, m = codes.reshape(out_f, nb, 32).to(torch.int64), None
    xq, s, c = reference_quant(x)
    isum = torch.einsum("rbj,obj->rob", xq, wq)  # [n, O, nb], exact in int64
    xm = c.float() * s  # [n, nb]
    acc = torch.zeros(x.shape[0], out_f)
    for b in range(nb):
        f = isum[:, :, b].float() * s[:, b, None]
        acc = fma32(f, d[None, :, b].expand_as(acc), acc)
        if m is not None:
            acc = fma32(m[None, :, b].expand_as(acc), xm[:, b, None].expand_as(acc), acc)
    acc = acc + lin.bias.detach() if lin.bias is not None else acc
    for j, dim in enumerate(kept):
        acc = fma32(w[None, :, dim].expand_as(acc), xs[:, j, None].expand_as(acc), acc)
    return acc



def int8_layer(case: str, isa: str, kernel_dir) -> tuple[nn.Linear, QLinear]:
    return compressed(case, isa, kernel_dir, "int8")


def activations(n: int, in_f: int, seed: int) -> torch.Tensor:
    """Wide-range rows with an all-zero block and outlier dimensions (as a hidden state has)."""
    x = wide_range_x(n, in_f, seed)
    x[3, :32] = 0.0
    x[:, 5] *= 60
    return x


def test_reference_is_close_to_the_float_layer_and_has_teeth():
    lin = nn.Linear(576, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(q4_weights(40, 576, seed=2))
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(1))
    ref, exact = reference_i8_linear(lin, x), x @ lin.weight.detach().T
    assert (ref - exact).norm() / exact.norm() < 0.02  # int8 activations: ~0.5% here
    assert not torch.equal(ref, exact)


@needs_kernel
@pytest.mark.parametrize("isa", isa_params())
def test_quantized_activations_equal_the_reference(isa, kernel_dir):
    int8_layer("q4", isa, kernel_dir)  # loads the variant's library
    x = activations(5, 96, seed=4)
    q, s, m = torch.empty(3, 5, 32, dtype=torch.int8), torch.empty(3, 5), torch.empty(3, 5)
    c = torch.empty(3, 5, dtype=torch.int32)
    build.quantize_library(kernel_isa(isa))(x.data_ptr(), 5, 96, q.data_ptr(), s.data_ptr(), m.data_ptr(),
                                            c.data_ptr())
    rq, rs, rc = reference_quant(x)
    assert torch.equal(q.permute(1, 0, 2).to(torch.int64), rq)  # block-major in the kernel: [nb, n, 32]
    assert torch.equal(s.T, rs) and torch.equal(c.T.to(torch.int64), -128 * rc)
    assert torch.equal(m.T, rc.float() * rs)
    assert rq[3, 0].eq(0).all() and rs[3, 0] == 0  # the zero block


@needs_kernel
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("isa", isa_params())
def test_int8_kernel_equals_its_reference_for_every_width(isa, case, kernel_dir):
    """Bits of the reference for n = 1..19 (one row, narrow and wide tiles with ragged ends) and for
    every row alone: a row's outputs never depend on the batch, and every variant is the same."""
    lin, q = int8_layer(case, isa, kernel_dir)
    x = activations(19, lin.in_features, seed=7)
    ref = reference_i8_linear(lin, x)
    for n in range(1, 20):
        assert torch.equal(q(x[:n]), ref[:n]), f"{isa} differs from the reference at n = {n}"
    for i in range(19):
        assert torch.equal(q(x[i : i + 1]), ref[i : i + 1])
    assert torch.equal(q(x[5:16]), ref[5:16])


@needs_kernel
@pytest.mark.parametrize("case", ["q4-panels-bias", "q8-panels"])
def test_int8_variants_give_the_same_bits_at_every_width_to_32(case, kernel_dir):
    x = activations(32, CASES[case][0]().shape[1], seed=8)
    outs = {isa: int8_layer(case, isa, kernel_dir)[1] for isa in available_isas()}
    want = outs["scalar"](x)
    for isa, layer in outs.items():
        for n in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, 32):
            assert torch.equal(layer(x[:n]), want[:n]), f"{isa} != scalar at n = {n}"


@needs_kernel
@pytest.mark.parametrize("case", ["q4-panels-bias", "q8-panels"])
def test_kept_inputs_equal_their_reference_and_every_variant_agrees(case, kernel_dir):
    """Inputs kept in float32 (engine/model/kernels/outliers.py): quantized as zeros, so the outlier
    dimension 5 no longer sets its block's scale, then added back after the integer part in the set's
    order; the reference's bits at every width and for every row alone, on every variant, and closer
    to the float layer than without them."""
    lin = CASES[case][0]
    outs = {}
    x = activations(19, lin().shape[1], seed=9)
    for isa in available_isas():
        ref_lin, q = int8_layer(case, isa, kernel_dir)
        dims = [5, 40, 3]  # any order: the kernel adds them in this one
        q.keep_inputs(torch.tensor(dims), ref_lin.weight.detach()[:, dims].t())
        ref = reference_i8_linear(ref_lin, x, dims)
        for n in (1, 2, 3, 5, 8, 13, 19):
            assert torch.equal(q(x[:n]), ref[:n]), f"{isa} differs from the reference at n = {n}"
        for i in (0, 3, 18):
            assert torch.equal(q(x[i: i + 1]), ref[i: i + 1])
        outs[isa] = q(x)
        exact = ref_lin(x)
        assert (ref - exact).abs().mean() < (reference_i8_linear(ref_lin, x) - exact).abs().mean()
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), f"{isa} != scalar"
    with pytest.raises(ValueError, match="kept inputs"):
        q.keep_inputs(torch.arange(17), torch.zeros(17, q.out_features))


def test_int8_packing_places_every_code():
    w = q4_weights(20, 64, seed=3)
    codes, d, m = recover_q4(w)
    packed, pd, pm = pack_q4_i8(codes, d.half(), m.half())
    assert packed.shape == (2, 2, 4, 64) and pd.shape == pm.shape == (2, 2, 16)
    blk = codes.reshape(20, 2, 16)
    q = torch.cat([blk & 0xF, blk >> 4], dim=-1)  # [O, nb, 32]
    for o, b, i in ((0, 0, 0), (17, 1, 31), (5, 0, 13), (19, 1, 6)):
        p, l, h, k = o // 16, o % 16, i // 8, i % 8
        byte = packed[p, b, h, 4 * l + k % 4]
        assert (byte >> 4 if k >= 4 else byte & 0xF) == q[o, b, i]
    assert packed[1, :, :, 16:].eq(0).all()  # padded outputs
    w8 = q8_weights(3, 32, seed=1)
    c8, _ = recover_q8(w8)
    p8, _ = pack_q8_i8(c8.view(torch.uint8), d[:3, :1].half())
    assert int(p8[0, 0, 2, 4 * 1 + 3]) == int(c8[1, 2 * 4 + 3]) + 128  # group 2, output 1, input 11
    assert p8[0, 0, :, 12:].eq(128).all()  # padded outputs: code 0, biased


@needs_kernel
def test_arithmetic_is_validated(kernel_dir):
    w = q4_weights(16, 64)
    with pytest.raises(ValueError, match="arithmetic"):
        QLinear(4, *recover_q4(w), None, 64, 16, kernel_dir, "scalar", "int4")
    from trserve.engine.model.loader import ModelConfig

    with pytest.raises(ValueError, match="arithmetic"):
        ModelConfig(arithmetic="fp8")
    with pytest.raises(ValueError, match="compressed kernels"):
        ModelConfig(arithmetic="int8", kernels="packed")


# ---- the native forward in the int8 arithmetic -----------------------------------------------------
@needs_kernel
def test_native_int8_tree_nodes_equal_tokens_decoded_alone_and_builds_agree(tmp_path):
    from tests.engine.model.test_native import HIDE, _prefilled, _row, quantized_llama

    outs = {}
    for isa in available_isas():
        model = quantized_llama(tmp_path, isa, arithmetic="int8")
        assert model.lm_head.arithmetic == "int8"
        outs[isa] = _nodes_against_alone(model, isa)
    for isa, got in outs.items():
        assert torch.equal(got, outs["scalar"]), f"{isa} != scalar"
    exact = quantized_llama(tmp_path, "scalar")
    with torch.inference_mode():
        e = _prefilled(exact, True, [list(range(7, 30)), list(range(40, 90))]).step(
            [_row([1, 2, 3, 4]), _row([3, 9, 7, 8, 8], [0, 1, 2, 1, 2], _tree(HIDE))])[1]
    assert not torch.equal(e, outs["scalar"])  # another arithmetic
    assert (e.argmax(-1) == outs["scalar"].argmax(-1)).float().mean() >= 0.6


def _tree(hide: float) -> torch.Tensor:
    """[5, 5] the visibility of a 5-node tree (parents 0, 1, 2, 0, 1 below the root)."""
    tree = torch.full((5, 5), hide)
    for i, anc in enumerate([[0], [0, 1], [0, 1, 2], [0, 3], [0, 1, 4]]):
        tree[i, anc] = 0.0
    return tree


def _nodes_against_alone(model, isa: str) -> torch.Tensor:
    """A tree verified beside another sequence: its first 3 nodes' logits must equal tokens 3, 9, 7
    decoded alone one by one; returns the tree's logits [5, V]."""
    from tests.engine.model.test_native import HIDE, _prefilled, _row

    with torch.inference_mode():
        alone = _prefilled(model, True, [list(range(40, 90))])
        want = []
        for t in (3, 9, 7):
            want.append(alone.step([_row([t])])[0][0])
            alone.keep([[0]])
        batch = _prefilled(model, True, [list(range(7, 30)), list(range(40, 90))])
        got = batch.step([_row([1, 2, 3, 4]), _row([3, 9, 7, 8, 8], [0, 1, 2, 1, 2], _tree(HIDE))])[1]
    for i in range(3):
        assert torch.equal(got[i], want[i]), f"{isa}: node {i} differs from the token decoded alone"
    return got


@needs_kernel
def test_native_int8_with_kept_inputs_is_batch_invariant_and_builds_agree(tmp_path):
    """The native forward with kept inputs (one set per layer input: q, k, v share theirs, gate and up
    theirs): tree nodes equal tokens decoded alone, the builds agree, and the kept inputs do change the
    numbers; a q whose set differs from its k's is refused."""
    from tests.engine.model.test_native import HIDE, _prefilled, _row, quantized_llama

    kept = {}
    for layer in range(2):
        for names, dims in ((("q_proj", "k_proj", "v_proj"), [7, 64, 100]), (("o_proj",), [3]),
                            (("gate_proj", "up_proj"), [1, 2, 127]), (("down_proj",), [0, 200, 255, 31])):
            for name in names:
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                kept[f"model.layers.{layer}.{part}.{name}"] = dims
    kept["lm_head"] = [5, 6]
    outs = {}
    for isa in available_isas():
        model = quantized_llama(tmp_path, isa, arithmetic="int8", kept_inputs=kept)
        assert model.model.layers[1].mlp.down_proj.kept.tolist() == [0, 200, 255, 31]
        outs[isa] = _nodes_against_alone(model, isa)
    for isa, got in outs.items():
        assert torch.equal(got, outs["scalar"]), f"{isa} != scalar"
    plain = quantized_llama(tmp_path, "scalar", arithmetic="int8")
    with torch.inference_mode():
        p = _prefilled(plain, True, [list(range(7, 30)), list(range(40, 90))]).step(
            [_row([1, 2, 3, 4]), _row([3, 9, 7, 8, 8], [0, 1, 2, 1, 2], _tree(HIDE))])[1]
    assert not torch.equal(p, outs["scalar"])
    kept["model.layers.0.self_attn.k_proj"] = [7, 64, 101]
    bad = quantized_llama(tmp_path, "scalar", arithmetic="int8", kept_inputs=kept)
    with pytest.raises(ValueError, match="kept inputs that differ"):
        _prefilled(bad, True, [list(range(7, 30))])


def test_ctypes_model_struct_is_forward_hs_tr_model():
    """native._Model mirrors csrc/forward.h's tr_model field by field (names, in order), the arithmetic an
    int64: a field added on one side only would shift every field after it."""
    import re
    from pathlib import Path

    from trserve.engine.model import native

    src = (Path(native.__file__).parent / "csrc" / "forward.h").read_text()
    end = src.index("} tr_model;")
    body = re.sub(r"/\*.*?\*/", "", src[src.rindex("typedef struct {", 0, end) + len("typedef struct {"):end], flags=re.S)
    names = []
    for decl in filter(str.strip, body.split(";")):
        first, *rest = decl.split(",")
        names += [first.split()[-1].lstrip("*")] + [r.strip().lstrip("*") for r in rest]
    assert [n for n, _ in native._Model._fields_] == names and len(names) > 20
    assert ("arith", ctypes.c_int64) in native._Model._fields_


def test_auto_arithmetic_is_int8_wherever_the_compressed_kernels_run():
    from trserve.engine.model.loader import ModelConfig, resolve_arithmetic

    assert ModelConfig().arithmetic == "auto" and ModelConfig(kernels="packed").arithmetic == "auto"
    assert resolve_arithmetic("auto", "avx2") == "int8" and resolve_arithmetic("auto", None) == "exact"
    assert resolve_arithmetic("exact", "avx512vnni") == "exact"


@pytest.mark.slow
def test_the_bundled_models_kept_inputs_are_what_calibration_picks_here(hf_reference):
    """engine/model/kernels/kept/: the shipped sets (which every host serving the bundled model uses, so
    a mixed fleet gives one answer) are what calibrating the float model picks on this host too; and the
    served int8 layers keep them."""
    import json

    from trserve.engine.model.kernels.outliers import SHIPPED, calibrate, calibration_key

    (path,) = SHIPPED.glob(f"kept-{calibration_key(hf_reference.fingerprint, hf_reference.model)}.json")
    shipped = json.loads(path.read_text())["kept"]
    assert calibrate(hf_reference.model, hf_reference.tokenizer) == shipped
    assert len(shipped) == 211 and all(len(v) == 4 for v in shipped.values())
    assert shipped["model.layers.3.self_attn.q_proj"] == shipped["model.layers.3.self_attn.v_proj"]


@pytest.mark.slow
def test_the_bundled_models_kept_key_pairs_are_what_calibration_picks_here(hf_reference):
    """engine/model/kernels/kept/keypairs-*.json: the rotary pair each KV head's int8 keys keep in float32
    (csrc/ikeys.h) is what calibrating the float model picks on this host too, a pair index per KV head
    and layer, and the served int8 model's k_proj layers carry them to the native forward."""
    import json

    from trserve.engine.model.kernels.outliers import SHIPPED, calibrate_pairs, calibration_key
    from trserve.engine.model.loader import ModelConfig, load_model

    (path,) = SHIPPED.glob(f"keypairs-{calibration_key(hf_reference.fingerprint, hf_reference.model)}.json")
    shipped = json.loads(path.read_text())["pairs"]
    assert calibrate_pairs(hf_reference.model, hf_reference.tokenizer) == shipped
    assert len(shipped) == 30 and all(len(p) == 3 and all(0 <= i < 32 for i in p) for p in shipped)
    served = load_model(ModelConfig(arithmetic="int8", kernels="compressed"))
    got = [layer.self_attn.k_proj.key_pair.tolist() for layer in served.model.get_decoder().layers]
    assert got == shipped


def test_a_calibration_is_keyed_by_the_model_s_norms_not_its_shape_alone():
    """outliers.py:calibration_key: two models of one shape and vocabulary (one fingerprint) with other
    norms get other keys, so neither reads the other's kept inputs; the same norms as float32 holding
    bfloat16 values or as bfloat16 (a converted file and its checkpoint) one key; the linear layers'
    weights and a norm not yet filled (meta) do not enter it."""
    from trserve.engine.model.kernels.outliers import calibration_key

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = torch.nn.Module()
        m.input_layernorm, m.norm, m.q_proj = torch.nn.RMSNorm(64), torch.nn.RMSNorm(64), torch.nn.Linear(64, 64)
        with torch.no_grad():
            m.input_layernorm.weight.copy_(torch.randn(64).to(torch.bfloat16).float())
            m.norm.weight.copy_(torch.randn(64).to(torch.bfloat16).float())
        return m

    a, b = model(0), model(1)
    key = calibration_key("llama-v49152-x", a)
    assert key.startswith("llama-v49152-x-n") and len(key) == len("llama-v49152-x-n") + 12
    assert calibration_key("llama-v49152-x", b) != key
    with torch.no_grad():
        a.q_proj.weight.add_(1.0)
    assert calibration_key("llama-v49152-x", a) == key  # the linears' weights do not enter it
    assert calibration_key("llama-v49152-x", a.to(torch.bfloat16)) == key
    with torch.no_grad():
        a.norm.weight[3] += 0.5
    assert calibration_key("llama-v49152-x", a) != key
    meta = model(0)
    meta.norm = torch.nn.RMSNorm(64, device="meta")
    assert calibration_key("llama-v49152-x", meta) != key  # (left out, not read)
