"""The native forward (engine/model/native.py, csrc/forward.c) on a tiny llama whose weights are
exact Q4_1 / Q8_0 blocks: it computes transformers' function, each token's logits do not depend on
the batch around it (tree == per-path, batch == alone), and its ISA builds give the same bits."""

import pytest
import torch

from trserve.engine.model.kernels.build import available_isas
from trserve.engine.model.kernels.outliers import attach_key_pairs
from trserve.engine.model.kernels.qlinear import quantize_linears
from trserve.engine.model.native import native_unsupported
from trserve.engine.model.runner import ModelRunner, RowInput
from tests.engine.model.test_qlinear import isa_params, needs_kernel, q4_weights, q8_weights
from tests.engine.model.tr_ar import assert_tr_equals_ar_natively

pytestmark = needs_kernel
HIDE = torch.finfo(torch.float32).min


def quantized_llama(tmp_path, isa: str = "auto", vocab: int = 256, seed: int = 0, bias: bool = False,
                    arithmetic: str = "exact", kept_inputs: dict[str, list[int]] | None = None, heads: int = 4,
                    key_pair: int | None = None):
    """A 2-layer llama (head_dim 128 / heads: 32, or 64 with heads=2; grouped KV) with Q4_1 linears and a
    Q8_0 LM head, on `isa` (int8: with `kept_inputs` per linear layer name and every KV head keeping
    rotary pair `key_pair` of its keys, engine/model/kernels/outliers.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=1024,
                         attention_bias=bias, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                o, n = mod.weight.shape
                # a x16 LM head (exact: a power of two on the scales) peaks next-token laws, so drafts get accepted
                w = q8_weights(o, n, seed + i) * 16 if name == "lm_head" else q4_weights(o, n, seed + i, scale=0.03)
                mod.weight.copy_(w)
                if mod.bias is not None:
                    mod.bias.copy_(torch.randn(o) * 0.1)
        for layer in model.model.layers:  # non-trivial norm weights
            layer.input_layernorm.weight.copy_(1 + 0.2 * torch.randn(128))
            layer.post_attention_layernorm.weight.copy_(1 + 0.2 * torch.randn(128))
    swapped, kept = quantize_linears(model, tmp_path, isa, arithmetic, kept_inputs)
    assert kept == 0 and swapped == 15
    if key_pair is not None:
        attach_key_pairs(model, [[key_pair + g for g in range(heads // 2)]] * 2)
    return model


def _row(tokens, depth=None, mask=None) -> RowInput:
    w = len(tokens)
    depth = torch.arange(w) if depth is None else torch.tensor(depth)
    mask = torch.full((w, w), HIDE).triu(1) if mask is None else mask
    return RowInput(torch.tensor(tokens), depth, mask)


def _prefilled(model, native: bool, prompts: list[list[int]]) -> ModelRunner:
    r = ModelRunner(model, len(prompts), torch.float32, native=native)
    for p in prompts:
        row = r.kv.open_row()
        r.prefill(row, torch.tensor(p), torch.tensor([len(p) - 1]))
        r.kv.activate(row)
    return r


def test_native_applies_and_matches_transformers(tmp_path):
    model = quantized_llama(tmp_path, bias=True)
    assert native_unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5)]
    with torch.inference_mode():
        hf, nv = _prefilled(model, False, prompts), _prefilled(model, True, prompts)
        assert nv.forward_kind == "native" and hf.forward_kind == "transformers"
        # a 4-node tree (root, two children, a grandchild) on row 0 and one token on row 1
        tree = torch.full((4, 4), HIDE)
        for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
            tree[i, anc] = 0.0
        rows = [_row([3, 9, 4, 7], [0, 1, 1, 2], tree), _row([11])]
        for a, b in zip(hf.step(rows), nv.step(rows)):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
        hf.keep([[0, 1, 3], [0]]), nv.keep([[0, 1, 3], [0]])
        nxt = [_row([5]), _row([6])]
        for a, b in zip(hf.step(nxt), nv.step(nxt)):
            torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)


def test_topk_rows_orders_ties_by_id_and_skips_nans(tmp_path):
    """The forward's top-k (csrc/forward.c topk_row): torch.topk's values, largest first, equal
    logits by lower id, so column 0 is torch.argmax's pick; NaNs never taken."""
    import ctypes

    from trserve.engine.model.kernels.build import _libs, kernel_isa

    quantized_llama(tmp_path)  # loads this CPU's library
    fn = _libs[kernel_isa()].trserve_topk_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def top(x, k):
        idx = torch.empty(x.shape[0], k, dtype=torch.int32)
        assert fn(x.data_ptr(), x.shape[0], x.shape[1], k, idx.data_ptr()) == 0
        return idx

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1000, generator=g)
    x[1, [7, 300, 999]] = 9.0  # a three-way tie at the top
    x[2, :] = 0.5  # all equal
    x[3, 100:200] = float("nan")
    idx = top(x, 8)
    assert torch.equal(x.gather(1, idx.long()), torch.topk(x.nan_to_num(-1e9), 8).values)
    assert idx[1, :3].tolist() == [7, 300, 999] and idx[2].tolist() == list(range(8))
    assert torch.equal(idx[:, 0].long(), x.nan_to_num(-1e9).argmax(-1))
    assert not ((idx[3] >= 100) & (idx[3] < 200)).any()
    assert top(torch.tensor([[float("nan")] * 3 + [1.0]]), 2).tolist() == [[3, -1]]


def test_runner_topk_equals_torch_topk_of_its_logits(tmp_path):
    model = quantized_llama(tmp_path)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        r = ModelRunner(model, 2, torch.float32, native=True, topk=8)
        for n in (20, 9):
            row = r.kv.open_row()
            logits = r.prefill(row, torch.randint(0, 256, (n,), generator=g), torch.arange(n))
            assert torch.equal(logits.gather(1, r.last_topk.long()), torch.topk(logits, 8).values)
            r.kv.activate(row)
        tree = torch.full((3, 3), HIDE)
        for i, anc in enumerate([[0], [0, 1], [0, 2]]):
            tree[i, anc] = 0.0
        out = r.step([_row([3, 9, 4], [0, 1, 1], tree), _row([11])])
        assert [t.shape for t in r.last_topk] == [(3, 8), (1, 8)] and r.last_probs is None  # not asked
        for lg, top in zip(out, r.last_topk):
            assert torch.equal(top[:, 0].long(), lg.argmax(-1))
            assert torch.equal(lg.gather(1, top.long()), torch.topk(lg, 8).values)


def test_runner_confidences_from_the_forward_equal_the_c_call_on_its_logits(tmp_path):
    """probs=True: the forward's pool computes each row's top-k confidences (csrc/forward.c
    top_probs_row) bit for bit as trserve_top_probs does on the logits it returned."""
    model = quantized_llama(tmp_path)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        r = ModelRunner(model, 3, torch.float32, native=True, topk=8)
        for n in (20, 9, 14):
            row = r.kv.open_row()
            r.prefill(row, torch.randint(0, 256, (n,), generator=g), torch.tensor([n - 1]))
            r.kv.activate(row)
        tree = torch.full((3, 3), HIDE)
        for i, anc in enumerate([[0], [0, 1], [0, 2]]):
            tree[i, anc] = 0.0
        out = r.step([_row([3, 9, 4], [0, 1, 1], tree), _row([11]), _row([7])], probs=True)
        assert [q.shape for q in r.last_probs] == [(3, 8), (1, 8), (1, 8)]
        for lg, top, q in zip(out, r.last_topk, r.last_probs):
            assert q.dtype == torch.uint8 and torch.equal(q, r.native.top_probs(lg, top))
        assert any(q.max() > 0 for q in r.last_probs)  # not all empty buckets


@pytest.mark.parametrize("arithmetic, key_pair", [("exact", None), ("int8", 3)])
def test_tree_nodes_equal_tokens_decoded_alone(tmp_path, arithmetic, key_pair):
    """Bit for bit: a tree's nodes, in a batch next to another sequence, give the logits the same
    tokens give decoded one at a time, alone (what makes TR == plain decoding exactly)."""
    model = quantized_llama(tmp_path, arithmetic=arithmetic, key_pair=key_pair)
    prompt = list(range(40, 90))
    other = list(range(7, 30))
    with torch.inference_mode():
        alone = _prefilled(model, True, [prompt])
        path = [3, 9, 7]
        want = []
        for t in path:
            want.append(alone.step([_row([t])])[0][0])
            alone.keep([[0]])
        batch = _prefilled(model, True, [other, prompt])
        tree = torch.full((5, 5), HIDE)
        for i, anc in enumerate([[0], [0, 1], [0, 1, 2], [0, 3], [0, 1, 4]]):  # path 0-1-2, side nodes 3, 4
            tree[i, anc] = 0.0
        got = batch.step([_row([1, 2, 3, 4]), _row([3, 9, 7, 8, 8], [0, 1, 2, 1, 2], tree)])[1]
    for i in range(3):
        assert torch.equal(got[i], want[i]), f"node {i} differs from the token decoded alone"


@pytest.mark.parametrize("isa", isa_params())
def test_topk_skipping_blocks_picks_what_taking_each_value_does(tmp_path, isa):
    """topk_row compares 16 values at a time with the K-th and skips blocks with none above it: its
    picks must be those of a stable sort by (-value, id), NaNs left out, at every length (tails that
    are not whole blocks), K up to 64, many ties, on every build."""
    import ctypes

    from trserve.engine.model.kernels.build import _libs

    quantized_llama(tmp_path, isa)  # loads that variant's library
    fn = _libs[isa].trserve_topk_rows
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    g = torch.Generator().manual_seed(11)
    for V in (1, 7, 16, 17, 33, 100, 1000, 4099):
        for K in sorted({1, 2, 8, 64} & set(range(1, min(V, 64) + 1))):
            x = torch.randint(-20, 20, (6, V), generator=g).float() / 4  # ties everywhere
            x[1] = torch.arange(V).float()  # ascending: the threshold rises in every block
            x[2, ::3] = float("nan")
            x[3] = 1.0
            idx = torch.empty(6, K, dtype=torch.int32)
            assert fn(x.data_ptr(), 6, V, K, idx.data_ptr()) == 0
            for r in range(6):
                order = sorted((i for i in range(V) if x[r, i] == x[r, i]), key=lambda i: (-float(x[r, i]), i))
                want = (order + [-1] * K)[:K]
                assert idx[r].tolist() == want, (isa, V, K, r)


# int8: integer key scores (csrc/ikeys.h; head_dim 64 takes the 16 x 16 transposes; with and without
# a kept rotary pair) and float16 values
@pytest.mark.parametrize("arithmetic, heads, key_pair", [("exact", 4, None), ("int8", 4, None), ("int8", 4, 3),
                                                         ("int8", 2, 5)])
@pytest.mark.parametrize("isa", isa_params())
def test_isa_builds_give_the_same_bits(tmp_path, isa, arithmetic, heads, key_pair):
    runs = available_isas()
    ref_isa = "scalar" if isa != "scalar" else runs[0]
    outs = {}
    for which in (isa, ref_isa):
        model = quantized_llama(tmp_path, which, arithmetic=arithmetic, heads=heads, key_pair=key_pair)
        with torch.inference_mode():
            r = _prefilled(model, True, [list(range(3, 60))])
            outs[which] = r.step([_row([5, 6, 7, 8])])[0]
    assert torch.equal(outs[isa], outs[ref_isa])


def test_kept_key_pairs_out_of_range_or_misshapen_are_refused(tmp_path):
    """A kept key pair (csrc/ikeys.h) must name a rotary pair of the head (0 .. head_dim / 2 - 1), one per
    KV head, as int32: else the native forward refuses the model instead of reading past them."""
    from trserve.engine.model.native import NativeForward

    model = quantized_llama(tmp_path, arithmetic="int8", key_pair=3)
    NativeForward(model)
    k = model.model.layers[1].self_attn.k_proj
    k.key_pair = torch.tensor([16, 0], dtype=torch.int32)  # head_dim 32: pairs 0 .. 15
    with pytest.raises(ValueError, match="out of range"):
        NativeForward(model)
    k.key_pair = torch.tensor([1], dtype=torch.int32)  # 2 KV heads
    with pytest.raises(ValueError, match="int32"):
        NativeForward(model)


@pytest.mark.parametrize("arithmetic, seed", [("exact", 3), ("int8", 4)])  # seeds whose drafts get accepted
def test_tr_equals_ar_on_the_native_forward(tmp_path, arithmetic, seed):
    model = quantized_llama(tmp_path, vocab=256, seed=seed, arithmetic=arithmetic)
    assert_tr_equals_ar_natively(model, "tiny-q", arithmetic)


def test_decode_loops_on_the_native_forward_keep_torch_single_threaded():
    """Inside a native decode loop torch's intra-op threads are 1 (its OpenMP workers, woken by a
    parallel host op, would spin on the kernels' cores), and the caller's setting comes back after;
    on transformers' forward nothing changes."""
    from trserve.engine.model.runner import quiet_torch_threads

    before = torch.get_num_threads()
    with quiet_torch_threads(True):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with quiet_torch_threads(False):
        assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), quiet_torch_threads(True):
        raise RuntimeError("a failed step")
    assert torch.get_num_threads() == before


def test_top_probs_match_torch_softmax(tmp_path):
    """The C confidences (csrc/forward.c trserve_top_probs) are torch's softmax of the same ids,
    bucketed as engine/tr/confidence.py does (off by at most one bucket: exp_poly against torch's exp)."""
    from trserve.engine.model.native import NativeForward
    from trserve.engine.tr.recycle import top_probs

    model = quantized_llama(tmp_path)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3000, generator=g) * 3
    x[2] = 0.0  # flat: every id 1/3000 -> bucket 0
    x[3, 17] = 40.0  # sure: bucket 255
    ids = torch.topk(x, 8).indices.to(torch.int32)
    q = NativeForward(model).top_probs(x, ids)
    ref = top_probs(x, ids)
    assert q.dtype == torch.uint8 and q.shape == (4, 8)
    assert (q.int() - ref.int()).abs().max() <= 1
    assert q[2].tolist() == [0] * 8 and q[3, 0] == 255


@pytest.mark.parametrize("isa", isa_params())
def test_values_round_to_float16_as_numpy_does(tmp_path, isa):
    """The int8 arithmetic stores values as float16 (csrc/vec.h:v_to_half): round to nearest
    even (numpy's rounding), subnormals kept, clamped to +-65504, a NaN to -65504, on every build."""
    import ctypes

    import numpy as np

    from trserve.engine.model.kernels.build import _libs

    quantized_llama(tmp_path, isa)  # loads that variant's library
    fn = _libs[isa].trserve_to_half
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    g = np.random.default_rng(5)
    ties = np.array([1 + (2 * k + 1) * 2.0 ** -11 for k in range(8)], dtype=np.float32)  # halfway cases
    x = np.concatenate([g.standard_normal(4000).astype(np.float32) * 30, ties, -ties,
                        np.float32([6e-8, 3e-8, 1e-7, 6.1e-5, 6.09e-5, -5.96e-8, 0.0, -0.0, 65504, 65519, 65520, 1e6,
                                    -1e6, np.inf, -np.inf, np.nan])]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 16, np.float32)])
    h = np.empty(len(x), np.uint16)
    assert fn(x.ctypes.data, len(x), h.ctypes.data) == 0
    want = np.clip(np.nan_to_num(x, nan=-65504.0, posinf=65504.0, neginf=-65504.0), -65504, 65504).astype(np.float16)
    assert np.array_equal(h, want.view(np.uint16))
