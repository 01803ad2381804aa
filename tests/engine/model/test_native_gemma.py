"""The native forward (engine/model/native.py, csrc/forward.c) on tiny Gemma 3 and Gemma 2 models: GeGLU
(gelu_pytorch_tanh), four (1 + w) RMSNorms per layer (the attention's and the MLP's outputs normed
before each residual add), Gemma 3's (1 + w) q/k norms, embeddings scaled by sqrt(hidden), attention
scaled by query_pre_attn_scalar^-0.5, local layers with a sliding window of 12 beside global ones (Gemma
3: each kind with its own rotary base), Gemma 2's attention and final logit soft-capping. Against
transformers' own forward past the window (exact: float rounding; int8: quantization noise), every
token's logits independent of the batch and tree around it (a tree path longer than the window), the
ISA builds' bits, TR == AR; and a bfloat16 checkpoint quantized at load onto the native forward."""

import pytest
import torch

from trserve.engine.model.kernels.build import available_isas
from trserve.engine.model.kernels.outliers import attach_key_pairs
from trserve.engine.model.kernels.qlinear import quantize_linears
from trserve.engine.model.native import layer_windows, native_unsupported
from trserve.engine.model.runner import ModelRunner
from tests.engine.model.test_native import HIDE, _prefilled, _row
from tests.engine.model.test_native_sliding import _kl
from tests.engine.model.test_qlinear import isa_params, needs_kernel, q4_weights, q8_weights
from tests.engine.model.tr_ar import assert_tr_equals_ar_natively

pytestmark = needs_kernel
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
WINDOW = 12


def tiny_gemma(gen: int, seed: int = 0, head: int | None = None):
    """A float 4-layer Gemma `gen` (2 or 3; hidden 128, 4 heads over 2 KV heads of 32, layers TYPES with
    window WINDOW) with exact Q4_1 linears and a Q8_0 LM head times `head` (a power of two, exact; None:
    x16 for Gemma 3, whose logits are not capped, peaking its laws so drafts get accepted; x4 under Gemma
    2's cap of 30), every norm weight w non-trivial (1 + w = 1 +- 0.2)."""
    import transformers as t

    torch.manual_seed(seed)
    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, sliding_window=WINDOW,
                 layer_types=TYPES, query_pre_attn_scalar=24, tie_word_embeddings=False,
                 attn_implementation="eager")
    model = (t.Gemma3ForCausalLM(t.Gemma3TextConfig(**shape)) if gen == 3 else
             t.Gemma2ForCausalLM(t.Gemma2Config(attn_logit_softcapping=20.0, final_logit_softcapping=30.0, **shape)))
    model.eval()
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                o, n = mod.weight.shape
                mod.weight.copy_(q8_weights(o, n, seed + i) * (head or (16 if gen == 3 else 4)) if name == "lm_head"
                                 else q4_weights(o, n, seed + i, scale=0.03))
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape))
    assert layer_windows(model) == ([WINDOW if t == "sliding_attention" else 0 for t in TYPES], None)
    return model


def quantized_gemma(tmp_path, gen: int, isa: str = "auto", seed: int = 0, arithmetic: str = "exact",
                    key_pair: int | None = None, head: int | None = None):
    """tiny_gemma on the compressed kernels of `isa` (int8: each KV head keeping rotary pair `key_pair`
    + its index of its keys in float32, csrc/ikeys.h)."""
    model = tiny_gemma(gen, seed, head)
    swapped, kept = quantize_linears(model, tmp_path, isa, arithmetic, None)
    assert kept == 0 and swapped == 29
    if key_pair is not None:
        attach_key_pairs(model, [[key_pair + g for g in range(2)]] * 4)
    return model


def _reference(model, ids: list[int], window: int = WINDOW) -> torch.Tensor:
    """transformers' own forward of the whole sequence, no cache -> logits [n, V]; with the local
    layers' window set to `window` for the call (their rotary base unchanged)."""
    cfg = model.config
    saved, cfg.sliding_window = cfg.sliding_window, window
    try:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        cfg.sliding_window = saved


def prefill_in_two(r: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """A 40-token prompt into a new active row of native runner `r` in two chunks (25, 15), past the
    window -> its logits at every position [40, V]."""
    assert r.forward_kind == "native" and len(prompt) == 40
    row = r.kv.open_row()
    got = torch.cat([r.prefill(row, torch.tensor(prompt[:25]), torch.arange(25)),
                     r.prefill(row, torch.tensor(prompt[25:]), torch.arange(15))])  # [40, V]
    r.kv.activate(row)
    return got


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float rounding at these logits' scale (up to ~300: 4 layers, a x16 head): 1e-3 is ~3e-6 of it."""
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)


def _tree(n: int) -> tuple[torch.Tensor, list[int]]:
    """A path of n nodes with a side node under path nodes 2 and 9: (mask [n + 2, n + 2], depths)."""
    tree = torch.full((n + 2, n + 2), HIDE)
    tree[:n, :n] = torch.full((n, n), HIDE).triu(1)
    tree[n, [0, 1, 2, n]] = 0.0
    tree[n + 1, list(range(10)) + [n + 1]] = 0.0
    return tree, list(range(n)) + [3, 10]


@pytest.mark.parametrize("gen", [3, 2])
def test_gemma_takes_the_native_forward_and_matches_transformers_past_the_window(tmp_path, gen):
    """A 40-token prompt prefilled in two chunks, a 4-node tree beside a one-token row, a step after
    keeping a path: transformers' forward to float rounding; the window changes those logits far more."""
    model = quantized_gemma(tmp_path, gen)
    assert native_unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    prompt, other = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 21))
    with torch.inference_mode():
        r = ModelRunner(model, 2, torch.float32, native=True)
        got = prefill_in_two(r, prompt)
        row = r.kv.open_row()
        r.prefill(row, torch.tensor(other), torch.tensor([20]))
        r.kv.activate(row)
        tree = torch.full((4, 4), HIDE)
        for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
            tree[i, anc] = 0.0
        step = r.step([_row([3, 9, 4, 7], [0, 1, 1, 2], tree), _row([11])])
        r.keep([[0, 1, 3], [0]])
        nxt = r.step([_row([5]), _row([6])])
    want = _reference(model, prompt)
    _close(got, want)
    assert (got - _reference(model, prompt, window=4096)).abs().max() > 1.0
    if gen == 2:
        assert got.abs().max() <= 30.0 and want.abs().max() > 20.0  # capped, and the cap reached for
    path, side = _reference(model, prompt + [3, 9, 7, 5]), _reference(model, prompt + [3, 4])
    _close(step[0], torch.stack([path[40], path[41], side[41], path[42]]))
    _close(nxt[0][0], path[43])
    _close(step[1][0], _reference(model, other + [11])[21])
    _close(nxt[1][0], _reference(model, other + [11, 6])[22])


@pytest.mark.parametrize("gen", [3, 2])
def test_gemma_int8_arithmetic_stays_near_transformers_past_the_window(tmp_path, gen):
    """The int8 arithmetic's next-token laws past the window follow transformers' windowed forward within
    quantization noise, and not its forward with the window widened. Under a x1 head (logits up to ~25)
    the KL is ~0.02 (Gemma's norms of each sublayer's output give every layer's noise full weight in the
    residual stream, where Llama's small random sublayers add little); top-1 agrees on >90% of rows."""
    m8 = quantized_gemma(tmp_path / "i8", gen, arithmetic="int8", key_pair=3, head=1)
    m = quantized_gemma(tmp_path / "f", gen, head=1)
    prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        r = ModelRunner(m8, 1, torch.float32, native=True)
        assert r.native.arithmetic == "int8"
        row = r.kv.open_row()
        got = torch.cat([r.prefill(row, torch.tensor(prompt[:30]), torch.arange(30)),
                         r.prefill(row, torch.tensor(prompt[30:]), torch.arange(18))])[16:]  # past the window
    want, full = _reference(m, prompt)[16:], _reference(m, prompt, window=4096)[16:]
    near, far = _kl(want, got).mean(), _kl(full, got).mean()
    assert near < 0.05 and far > 100 * near
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("gen", [3, 2])
@pytest.mark.parametrize("arithmetic, key_pair", [("exact", None), ("int8", 3)])
def test_gemma_tree_nodes_equal_tokens_decoded_alone_past_the_window(tmp_path, gen, arithmetic, key_pair):
    """Bit for bit: a tree whose path (14 nodes) is longer than the window, next to another sequence,
    gives on its path the logits those tokens give decoded one at a time alone."""
    model = quantized_gemma(tmp_path, gen, arithmetic=arithmetic, key_pair=key_pair)
    prompt, other = list(range(40, 90)), list(range(7, 30))
    path = [3, 9, 7, 1, 4, 4, 8, 2, 6, 5, 0, 3, 3, 9]
    with torch.inference_mode():
        alone = _prefilled(model, True, [prompt])
        want = []
        for t in path:
            want.append(alone.step([_row([t])])[0][0])
            alone.keep([[0]])
        batch = _prefilled(model, True, [other, prompt])
        tree, depth = _tree(len(path))
        got = batch.step([_row([1, 2, 3, 4]), _row(path + [8, 8], depth, tree)])[1]
    for i in range(len(path)):
        assert torch.equal(got[i], want[i]), f"node {i} differs from the token decoded alone"


@pytest.mark.parametrize("gen, arithmetic, key_pair", [(3, "exact", None), (3, "int8", 3), (2, "exact", None),
                                                       (2, "int8", None)])
@pytest.mark.parametrize("isa", isa_params())
def test_gemma_isa_builds_give_the_same_bits(tmp_path, isa, gen, arithmetic, key_pair):
    runs = available_isas()
    ref_isa = "scalar" if isa != "scalar" else runs[0]
    outs = {}
    for which in (isa, ref_isa):
        model = quantized_gemma(tmp_path, gen, which, arithmetic=arithmetic, key_pair=key_pair)
        with torch.inference_mode():
            r = ModelRunner(model, 1, torch.float32, native=True)
            row = r.kv.open_row()
            pre = r.prefill(row, torch.arange(3, 60), torch.arange(57))
            r.kv.activate(row)
            outs[which] = torch.cat([pre, r.step([_row([5, 6, 7, 8])])[0]])
    assert torch.equal(outs[isa], outs[ref_isa])


# seeds whose drafts get accepted (exact: 1.77 and 1.95 at best, of 3 prompts)
@pytest.mark.parametrize("gen, arithmetic, seed", [(3, "exact", 4), (3, "int8", 4), (2, "exact", 1), (2, "int8", 1)])
def test_gemma_tr_equals_ar_past_the_window(tmp_path, gen, arithmetic, seed):
    model = quantized_gemma(tmp_path, gen, seed=seed, arithmetic=arithmetic)
    assert_tr_equals_ar_natively(model, f"tiny-gemma{gen}", arithmetic, prompt_len=40)


def test_gemma_variants_the_forward_does_not_compute_are_refused(tmp_path):
    model = quantized_gemma(tmp_path, 3)
    assert native_unsupported(model) is None
    model.config.hidden_activation = "gelu"  # the exact erf form: not the tanh form the C computes
    assert "activation" in native_unsupported(model)
    model.config.hidden_activation = "gelu_pytorch_tanh"
    model.config.use_bidirectional_attention = True
    assert "bidirectional" in native_unsupported(model)
    model.config.use_bidirectional_attention = False
    model.model.layers[1].post_feedforward_layernorm = torch.nn.RMSNorm(128)  # y = w * normed: not Gemma's
    assert "post_feedforward_layernorm" in native_unsupported(model)


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_a_gemma_checkpoint_quantized_at_load_runs_on_the_native_forward(tmp_path, family):
    """A random 2-layer bfloat16 checkpoint (the bundled vocabulary; a local layer with a window of 16,
    shorter than the prompts, and a global one), loaded as `trserve serve --model DIR` loads it (built on
    the meta device, its embedding scale set from its module, quantized to q8_0): the native forward,
    as the worker's startup line says; exact greedy equals transformers' on the rebuilt weights; TR ==
    AR in the exact and the int8 arithmetic."""
    from trserve.engine import Decoder, DecoderConfig, GenerationRequest
    from trserve.engine.model.loader import ModelConfig
    from trserve.engine.runtime import RuntimeInfo
    from tests.engine.model.test_checkpoint import _prompts, _reference as _rebuilt, _same_or_near_tie, _tiny, \
        _tr_equals_ar
    from tests.engine.test_lossless import _generate

    folder, cache = _tiny(tmp_path / "ckpt", family), tmp_path / "cache"
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="exact",
                                                cache_dir=str(cache))))
    assert (d.loaded.forward, d.loaded.arithmetic, d.loaded.quantize) == ("native", "exact", "q8_0")
    assert "forward=native" in str(RuntimeInfo.of(d)) and "quantize=q8_0" in str(RuntimeInfo.of(d))
    stock = _rebuilt(folder, "q8_0", next((cache / "quantized").glob("q8_0-*")))
    for ids in _prompts(d, 2):
        assert len(ids) > 16  # past the window
        ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True)).ids
        ref, logits = _generate(stock, ids, 24)
        _same_or_near_tie(ours, ref, logits)
    _tr_equals_ar(d, 2, 24)
    d8 = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="int8",
                                                 cache_dir=str(cache))))
    assert (d8.loaded.forward, d8.loaded.arithmetic) == ("native", "int8")
    _tr_equals_ar(d8, 2, 24)


@pytest.mark.parametrize("isa", isa_params())
def test_gelu_tanh_form_is_transformers_function_to_5e_7_and_the_same_bits_on_every_build(isa, kernel_dir):
    """The GeGLU activation alone (csrc/forward.c:trserve_gated, gelu_pytorch_tanh written g / (1 + exp(-2c)))
    against transformers' own (torch's 0.5 g (1 + tanh(c))) on [-12, 12]: within 5e-7 (docs/kernels.md),
    not torch's bits everywhere (about half of them); below -3, where torch's 1 + tanh(c) cancels, within
    1e-8 of the function in float64; and the scalar build's bits on every build."""
    import ctypes
    import math

    from transformers.activations import ACT2FN

    from trserve.engine.model.kernels.build import _libs, _library

    def gated(which: str, x: torch.Tensor, act: int = 1) -> tuple[int, torch.Tensor]:
        _library(kernel_dir, which)  # loads that variant's library
        g, u, sc = x.clone(), torch.ones_like(x), torch.empty_like(x)
        rc = _libs[which].trserve_gated(act, ctypes.c_void_p(g.data_ptr()), ctypes.c_void_p(u.data_ptr()), x.numel(),
                                        ctypes.c_void_p(sc.data_ptr()))
        return rc, g

    x = torch.cat([torch.linspace(-12, 12, 24001), torch.randn(8000, generator=torch.Generator().manual_seed(3)) * 3])
    rc, y = gated(isa, x)
    assert rc == 0 and gated(isa, x[:16], act=2)[0] == -1
    want = ACT2FN["gelu_pytorch_tanh"](x)
    assert (y - want).abs().max() <= 5e-7 and not torch.equal(y, want)
    xd = x.double()
    exact = 0.5 * xd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    tail = x < -3
    assert (y.double() - exact)[tail].abs().max() <= 1e-8 < (want.double() - exact)[tail].abs().max()
    assert torch.equal(y, gated("scalar", x)[1])
