"""The native forward (engine/model/native.py, csrc/forward.c) with sliding-window attention: a tiny
Mistral (every layer's window 8) and a tiny Qwen2 / Qwen3 (use_sliding_window, max_window_layers=1:
layer 0 full, layer 1 a window of 12), prompts and decoding well past the window. Windows are applied
as transformers' masks apply them (a key at position k visible from position p iff p - k < window:
checked against transformers' own forward, which the window changes far beyond rounding), every
token's logits stay independent of the batch and tree around it in both arithmetics (a tree path
longer than the window included), the ISA builds give the same bits, and TR == AR on them."""

import pytest
import torch

from trserve.core.errors import InvalidArgument
from trserve.engine.model.kernels.build import available_isas
from trserve.engine.model.kernels.outliers import attach_key_pairs
from trserve.engine.model.kernels.qlinear import quantize_linears
from trserve.engine.model.native import layer_windows, native_unsupported
from trserve.engine.model.runner import ModelRunner
from tests.engine.model.test_native import HIDE, _prefilled, _row
from tests.engine.model.test_qlinear import isa_params, needs_kernel, q4_weights, q8_weights
from tests.engine.model.tr_ar import assert_tr_equals_ar_natively

pytestmark = needs_kernel
WINDOWS = {"mistral": [8, 8], "qwen2": [0, 12], "qwen3": [0, 12]}


def tiny_windowed(arch: str, seed: int = 0):
    """A float 2-layer model of `arch` (hidden 128, 4 heads over 2 KV heads of 32) with sliding windows
    (WINDOWS), exact Q4_1 linears and a Q8_0 x16 LM head as quantized_llama's, Qwen2's q/k/v biases
    and non-trivial norm weights (Qwen3's q/k norms included)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, \
        Qwen3ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                 attn_implementation="sdpa")
    if arch == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **shape))
    else:
        cfg, cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
        model = cls(cfg(use_sliding_window=True, sliding_window=12, max_window_layers=1, head_dim=32, **shape))
    model.eval()
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                o, n = mod.weight.shape
                w = q8_weights(o, n, seed + i) * 16 if name == "lm_head" else q4_weights(o, n, seed + i, scale=0.03)
                mod.weight.copy_(w)
                if mod.bias is not None:
                    mod.bias.copy_(torch.randn(o) * 0.1)
        for layer in model.model.layers:
            a = layer.self_attn
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, getattr(a, "q_norm", None),
                         getattr(a, "k_norm", None)):
                if norm is not None:
                    norm.weight.copy_(1 + 0.2 * torch.randn(norm.weight.shape))  # [128], or [head_dim]
    assert layer_windows(model) == (WINDOWS[arch], None)
    return model


def quantized_windowed(tmp_path, arch: str, isa: str = "auto", seed: int = 0, arithmetic: str = "exact",
                       key_pair: int | None = None):
    """tiny_windowed on the compressed kernels of `isa` (int8: each KV head keeping rotary pair
    `key_pair` + its index of its keys in float32, csrc/ikeys.h)."""
    model = tiny_windowed(arch, seed)
    swapped, kept = quantize_linears(model, tmp_path, isa, arithmetic, None)
    assert kept == 0 and swapped == 15
    if key_pair is not None:
        attach_key_pairs(model, [[key_pair + g for g in range(2)]] * 2)
    return model


def _reference(model, ids: list[int], windows: bool = True) -> torch.Tensor:
    """transformers' own forward of the whole sequence, no cache -> logits [n, V]; windows False: with
    every layer's attention full instead (the config's window or layer types set aside for the call)."""
    cfg = model.config
    saved = cfg.sliding_window, getattr(cfg, "layer_types", None)
    if not windows:
        if saved[1] is not None:
            cfg.layer_types = ["full_attention"] * len(saved[1])
        else:
            cfg.sliding_window = None
    try:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    finally:
        cfg.sliding_window = saved[0]
        if saved[1] is not None:
            cfg.layer_types = saved[1]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def _kl(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """KL(softmax a || softmax b) per row: a, b [n, V] -> [n]."""
    p, q = a.log_softmax(-1), b.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1)


def test_layer_windows_follow_transformers_configs():
    """Mistral: config.sliding_window on every layer (None: full); Qwen2/Qwen3: the layers layer_types
    calls sliding (from use_sliding_window and max_window_layers); what cannot be mirrored is refused."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
        Qwen2ForCausalLM

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2)
    assert layer_windows(MistralForCausalLM(MistralConfig(sliding_window=4096, **small))) == ([4096] * 3, None)
    assert layer_windows(MistralForCausalLM(MistralConfig(sliding_window=None, **small))) == ([0] * 3, None)
    qwen = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, **small))
    assert layer_windows(qwen) == ([0, 16, 16], None)
    plain = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=False, sliding_window=16, max_window_layers=1, **small))
    assert layer_windows(plain) == ([0, 0, 0], None)
    qwen.config.use_sliding_window = False  # edited after the config derived its layer types
    assert "use_sliding_window" in layer_windows(qwen)[1]
    qwen.config.use_sliding_window = True
    qwen.config.sliding_window = 32  # the modules were built with 16
    assert "layer 1" in layer_windows(qwen)[1]
    qwen.config.sliding_window = 16
    qwen.config.layer_types = ["full_attention", "sliding_attention", "chunked_attention"]
    assert "layer types" in layer_windows(qwen)[1]
    llama = LlamaForCausalLM(LlamaConfig(**small))
    assert layer_windows(llama) == ([0] * 3, None)
    llama.config.sliding_window = 16
    assert "sliding" in layer_windows(llama)[1]


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_native_matches_transformers_past_the_window(tmp_path, arch):
    """A 40-token prompt prefilled in two chunks (25, 15: the second chunk's early keys fall out of its
    late queries' window), a 4-node tree beside a one-token row, and a step after keeping a path:
    transformers' forward of the same sequences to float rounding. The window changes those logits
    by far more than that (transformers with full attention), so it is applied, and at the right
    positions."""
    model = quantized_windowed(tmp_path, arch)
    assert native_unsupported(model) is None
    g = torch.Generator().manual_seed(1)
    prompt, other = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 21))
    with torch.inference_mode():
        r = ModelRunner(model, 2, torch.float32, native=True)
        assert r.forward_kind == "native" and r.native.windows == WINDOWS[arch]
        row = r.kv.open_row()
        got = torch.cat([r.prefill(row, torch.tensor(prompt[:25]), torch.arange(25)),
                         r.prefill(row, torch.tensor(prompt[25:]), torch.arange(15))])  # [40, V]
        r.kv.activate(row)
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
    assert (got - _reference(model, prompt, windows=False)).abs().max() > 1.0
    path, side = _reference(model, prompt + [3, 9, 7, 5]), _reference(model, prompt + [3, 4])
    _close(step[0], torch.stack([path[40], path[41], side[41], path[42]]))
    _close(nxt[0][0], path[43])
    _close(step[1][0], _reference(model, other + [11])[21])
    _close(nxt[1][0], _reference(model, other + [11, 6])[22])


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_int8_arithmetic_applies_the_window(tmp_path, arch):
    """The int8 arithmetic (integer key scores, csrc/ikeys.h) with the window: its next-token laws past
    the window follow transformers' windowed forward within quantization noise, and not transformers'
    full-attention forward."""
    m8 = quantized_windowed(tmp_path / "i8", arch, arithmetic="int8", key_pair=3)
    m = quantized_windowed(tmp_path / "f", arch)
    prompt = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        r = ModelRunner(m8, 1, torch.float32, native=True)
        assert r.native.arithmetic == "int8"
        row = r.kv.open_row()
        got = torch.cat([r.prefill(row, torch.tensor(prompt[:30]), torch.arange(30)),
                         r.prefill(row, torch.tensor(prompt[30:]), torch.arange(18))])[16:]  # past the windows
    want, full = _reference(m, prompt)[16:], _reference(m, prompt, windows=False)[16:]
    near, far = _kl(want, got).mean(), _kl(full, got).mean()
    assert far > 10 * near
    assert (want.argmax(-1) == got.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("arithmetic, key_pair", [("exact", None), ("int8", 3)])
def test_tree_nodes_equal_tokens_decoded_alone_past_the_window(tmp_path, arch, arithmetic, key_pair):
    """Bit for bit: a tree whose path (14 nodes) is longer than the window, in a batch next to another
    sequence, gives on its path the logits those tokens give decoded one at a time alone (where its
    ancestors are context columns, there new keys masked by position)."""
    model = quantized_windowed(tmp_path, arch, arithmetic=arithmetic, key_pair=key_pair)
    prompt, other = list(range(40, 90)), list(range(7, 30))
    path = [3, 9, 7, 1, 4, 4, 8, 2, 6, 5, 0, 3, 3, 9]
    with torch.inference_mode():
        alone = _prefilled(model, True, [prompt])
        want = []
        for t in path:
            want.append(alone.step([_row([t])])[0][0])
            alone.keep([[0]])
        batch = _prefilled(model, True, [other, prompt])
        n = len(path)
        tree = torch.full((n + 2, n + 2), HIDE)
        tree[:n, :n] = torch.full((n, n), HIDE).triu(1)  # the path: node i sees nodes 0..i
        tree[n, [0, 1, 2, n]] = 0.0  # a side node under path node 2
        tree[n + 1, list(range(10)) + [n + 1]] = 0.0  # and one under path node 9
        depth = list(range(n)) + [3, 10]
        got = batch.step([_row([1, 2, 3, 4]), _row(path + [8, 8], depth, tree)])[1]
    for i in range(n):
        assert torch.equal(got[i], want[i]), f"node {i} differs from the token decoded alone"


@pytest.mark.parametrize("arch, arithmetic, key_pair", [("mistral", "exact", None), ("mistral", "int8", 3),
                                                        ("qwen2", "exact", None), ("qwen2", "int8", None)])
@pytest.mark.parametrize("isa", isa_params())
def test_isa_builds_give_the_same_bits_with_windows(tmp_path, isa, arch, arithmetic, key_pair):
    """A 57-token prefill (one chunk: its new keys masked by the window) and a 4-token step: the same
    bits on every build."""
    runs = available_isas()
    ref_isa = "scalar" if isa != "scalar" else runs[0]
    outs = {}
    for which in (isa, ref_isa):
        model = quantized_windowed(tmp_path, arch, which, arithmetic=arithmetic, key_pair=key_pair)
        with torch.inference_mode():
            r = ModelRunner(model, 1, torch.float32, native=True)
            row = r.kv.open_row()
            pre = r.prefill(row, torch.arange(3, 60), torch.arange(57))
            r.kv.activate(row)
            outs[which] = torch.cat([pre, r.step([_row([5, 6, 7, 8])])[0]])
    assert torch.equal(outs[isa], outs[ref_isa])


# seeds whose drafts get accepted (1.3-3.3 at best, of 3 prompts)
@pytest.mark.parametrize("arch, arithmetic, seed", [("mistral", "exact", 3), ("mistral", "int8", 3),
                                                    ("qwen2", "exact", 7), ("qwen2", "int8", 7)])
def test_tr_equals_ar_past_the_window(tmp_path, arch, arithmetic, seed):
    model = quantized_windowed(tmp_path, arch, seed=seed, arithmetic=arithmetic)
    assert_tr_equals_ar_natively(model, f"tiny-{arch}", arithmetic, prompt_len=40)


def test_transformers_forward_keeps_refusing_sliding_windows(tmp_path):
    """Only the native forward applies windows over BatchKV's rows: a runner on transformers' forward
    refuses a sliding-window model with its message (its 4D masks carry no window)."""
    model = quantized_windowed(tmp_path, "qwen2")
    with pytest.raises(InvalidArgument, match="full-attention KV layers.*DynamicSlidingWindowLayer"):
        ModelRunner(model, 1, torch.float32, native=False)
    assert ModelRunner(model, 1, torch.float32).forward_kind == "native"
