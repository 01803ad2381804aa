"""The native forward (engine/model/native.py, csrc/forward.c) on a tiny Qwen3: its per-head q/k
RMSNorms (after q_proj / k_proj, before rotary) give transformers' function, each token's logits do
not depend on the batch around it in either arithmetic, its ISA builds give the same bits, and TR ==
AR on it. The norm weights are far from 1 per dim (1 + 0.2 randn), so a norm skipped, or applied after
rotary (which does not commute with a per-dim weight), changes the logits well beyond float rounding."""

import pytest
import torch

from trserve.engine.model.kernels.build import available_isas
from trserve.engine.model.kernels.outliers import attach_key_pairs, calibrate, calibrate_pairs
from trserve.engine.model.kernels.qlinear import quantize_linears
from trserve.engine.model.native import native_unsupported
from tests.engine.model.test_native import HIDE, _prefilled, _row
from tests.engine.model.test_qlinear import isa_params, needs_kernel, q4_weights, q8_weights
from tests.engine.model.tr_ar import assert_tr_equals_ar_natively

pytestmark = needs_kernel


def tiny_qwen3(seed: int = 0, head_dim: int = 32, vocab: int = 256):
    """A float 2-layer Qwen3 (hidden 128, 4 heads over 2 KV heads of `head_dim`: 32 = hidden / heads, or
    64, wider) whose linears are exact Q4_1 blocks (a Q8_0 x16 LM head, as quantized_llama's), with
    non-trivial RMSNorm weights, q/k norms included."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=1024,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                o, n = mod.weight.shape
                w = q8_weights(o, n, seed + i) * 16 if name == "lm_head" else q4_weights(o, n, seed + i, scale=0.03)
                mod.weight.copy_(w)
        for layer in model.model.layers:
            layer.input_layernorm.weight.copy_(1 + 0.2 * torch.randn(128))
            layer.post_attention_layernorm.weight.copy_(1 + 0.2 * torch.randn(128))
            layer.self_attn.q_norm.weight.copy_(1 + 0.2 * torch.randn(head_dim))  # [head_dim]
            layer.self_attn.k_norm.weight.copy_(1 + 0.2 * torch.randn(head_dim))
    return model


def quantized_qwen3(tmp_path, isa: str = "auto", seed: int = 0, head_dim: int = 32, arithmetic: str = "exact",
                    key_pair: int | None = None):
    """tiny_qwen3 on the compressed kernels of `isa` (int8: every KV head keeping rotary pair `key_pair`
    + its index of its keys in float32, csrc/ikeys.h)."""
    model = tiny_qwen3(seed, head_dim)
    swapped, kept = quantize_linears(model, tmp_path, isa, arithmetic, None)
    assert kept == 0 and swapped == 15
    if key_pair is not None:
        attach_key_pairs(model, [[key_pair + g for g in range(2)]] * 2)
    return model


@pytest.mark.parametrize("head_dim", [32, 64])
def test_qwen3_takes_the_native_forward_and_matches_transformers(tmp_path, head_dim):
    """Logits of a prefill, a 4-node tree beside a one-token row, and a step after keeping a path:
    transformers' Qwen3 forward to float rounding (q/k norms where Qwen3Attention puts them)."""
    model = quantized_qwen3(tmp_path, head_dim=head_dim)
    assert native_unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5)]
    with torch.inference_mode():
        hf, nv = _prefilled(model, False, prompts), _prefilled(model, True, prompts)
        assert nv.forward_kind == "native" and hf.forward_kind == "transformers"
        assert nv.native.head_dim == head_dim
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


@pytest.mark.parametrize("head_dim", [32, 64])
def test_qwen3_int8_arithmetic_stays_near_transformers(tmp_path, head_dim):
    """The int8 arithmetic writes its keys (float16 slots, a kept pair: csrc/ikeys.h) after its own
    q/k norm and rotary: its next-token laws stay within quantization noise of transformers' (KL
    ~1e-6 here; a key norm skipped or misplaced in that path gives laws far apart)."""
    m8 = quantized_qwen3(tmp_path / "i8", head_dim=head_dim, arithmetic="int8", key_pair=3)
    m = quantized_qwen3(tmp_path / "f", head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (37, 5)]
    with torch.inference_mode():
        hf, nv = _prefilled(m, False, prompts), _prefilled(m8, True, prompts)
        assert nv.forward_kind == "native" and nv.native.arithmetic == "int8"
        rows = [_row([3, 9, 4, 7]), _row([11])]
        for a, b in zip(hf.step(rows), nv.step(rows)):  # [w, V] each
            p, q = a.log_softmax(-1), b.log_softmax(-1)
            assert (p.exp() * (p - q)).sum(-1).max() < 1e-3
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arithmetic, head_dim, key_pair", [("exact", 32, None), ("exact", 64, None),
                                                            ("int8", 32, 3), ("int8", 64, 5)])
def test_qwen3_tree_nodes_equal_tokens_decoded_alone(tmp_path, arithmetic, head_dim, key_pair):
    """Bit for bit: a tree's nodes, in a batch next to another sequence, give the logits the same tokens
    give decoded one at a time alone (the q/k norms are per token and head, in a fixed order)."""
    model = quantized_qwen3(tmp_path, head_dim=head_dim, arithmetic=arithmetic, key_pair=key_pair)
    prompt, other, path = list(range(40, 90)), list(range(7, 30)), [3, 9, 7]
    with torch.inference_mode():
        alone = _prefilled(model, True, [prompt])
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


@pytest.mark.parametrize("arithmetic, head_dim, key_pair", [("exact", 32, None), ("exact", 64, None),
                                                            ("int8", 32, 3), ("int8", 64, None)])
@pytest.mark.parametrize("isa", isa_params())
def test_qwen3_isa_builds_give_the_same_bits(tmp_path, isa, arithmetic, head_dim, key_pair):
    runs = available_isas()
    ref_isa = "scalar" if isa != "scalar" else runs[0]
    outs = {}
    for which in (isa, ref_isa):
        model = quantized_qwen3(tmp_path, which, head_dim=head_dim, arithmetic=arithmetic, key_pair=key_pair)
        with torch.inference_mode():
            r = _prefilled(model, True, [list(range(3, 60))])
            outs[which] = r.step([_row([5, 6, 7, 8])])[0]
    assert torch.equal(outs[isa], outs[ref_isa])


@pytest.mark.parametrize("arithmetic, seed", [("exact", 3), ("int8", 3)])  # seeds whose drafts get accepted (~1.8)
def test_qwen3_tr_equals_ar_on_the_native_forward(tmp_path, arithmetic, seed):
    model = quantized_qwen3(tmp_path, seed=seed, arithmetic=arithmetic)
    assert_tr_equals_ar_natively(model, "tiny-qwen3", arithmetic)


def test_qwen3_with_windows_it_cannot_mirror_or_other_qk_norms_keeps_transformers_forward(tmp_path):
    """A Qwen3 whose sliding windows the C forward cannot mirror exactly (sliding layers without a
    window, an attention whose own window its config does not give), or whose q/k norms are not
    per-head RMSNorms over head_dim, is refused. Windows transformers does apply take the native
    forward (tests/engine/model/test_native_sliding.py)."""
    from transformers import Qwen3Config

    model = quantized_qwen3(tmp_path)
    assert native_unsupported(model) is None
    cfg = Qwen3Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    model.config.sliding_window, model.config.use_sliding_window = 16, True
    # the layer types derived when the config was built keep both layers full: transformers' masks too
    assert native_unsupported(model) is None
    model.config.sliding_window, model.config.use_sliding_window = None, False
    model.config.layer_types = cfg.layer_types
    assert "sliding" in native_unsupported(model)
    model.config.layer_types = ["full_attention"] * 2
    model.model.layers[1].self_attn.sliding_window = 16
    assert "sliding" in native_unsupported(model)
    model.model.layers[1].self_attn.sliding_window = None
    assert native_unsupported(model) is None
    model.model.layers[1].self_attn.k_norm = torch.nn.RMSNorm(32, eps=1e-6)  # not Qwen3's module
    assert "k_norm" in native_unsupported(model)


class _BytesTokenizer:
    """A chat template that is the prompt's bytes (ids 0..255): what outliers._run_prompts calls (it takes
    the chat template where the tokenizer has one: outliers.calibration_ids)."""

    chat_template = "the prompt's bytes"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False):
        return list(messages[-1]["content"].encode())


def test_qwen3_calibration_reads_keys_after_k_norm():
    """outliers.calibrate_pairs picks each KV head's kept rotary pair from the keys rotary turns: on
    Qwen3 after k_norm. A k_norm weighting pair 5 (dims 5 and 5 + D/2) x10 makes it every head's
    pair, which k_proj's outputs alone would not pick; the kept inputs of q/k/v (one input) agree."""
    model = tiny_qwen3(seed=7)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight[[5, 21]] = 10.0  # D = 32: pair 5 is dims 5, 21
    assert calibrate_pairs(model, _BytesTokenizer()) == [[5, 5], [5, 5]]
    kept = calibrate(model, _BytesTokenizer())
    assert len(kept) == 15 and all(len(v) == 4 for v in kept.values())
    a = "model.layers.1.self_attn."
    assert kept[a + "q_proj"] == kept[a + "k_proj"] == kept[a + "v_proj"]
