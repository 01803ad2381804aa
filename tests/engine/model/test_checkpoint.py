"""Transformers checkpoints quantized once at load (issue 57; engine/model/checkpoint.py): a bfloat16
checkpoint takes the compressed kernels and the native forward in every layer instead of float32
oneDNN, its exact arithmetic equals transformers' greedy decoding on the quantized (rebuilt) weights,
TR equals plain decoding token for token in both arithmetics, the blocks are cached and read back, and
weights that already are exact blocks are kept as they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trserve.engine import Decoder, DecoderConfig, GenerationRequest
from trserve.engine.model import checkpoint
from trserve.engine.model.checkpoint import CheckpointWeights, layer_type
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.kernels.kquants import rebuild
from trserve.engine.model.loader import ModelConfig, builtin_model_dir, load_model, model_spec_of
from tests.conftest import load_prompts
from tests.engine.test_lossless import NEAR_TIE_EPS, _generate

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")


def _save(model, folder, dtype=torch.bfloat16):
    from transformers import AutoTokenizer

    model.to(dtype).save_pretrained(folder)
    AutoTokenizer.from_pretrained(builtin_model_dir()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bundled_bf16(tmp_path_factory):
    """The bundled model saved as a bfloat16 checkpoint (its Q4_1 weights rounded: no exact blocks left)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(builtin_model_dir(), dtype=torch.float32)
    return _save(model, tmp_path_factory.mktemp("smol-bf16"))


def _tiny(folder, family: str, window: int | None = None, inter: int = 640):
    """A random 2-layer model of `family` with the bundled vocabulary, rows of 256 (Q4_K/Q6_K super-blocks)
    and of 640 (not: the fallbacks), as a bfloat16 checkpoint."""
    import transformers as t

    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=256, intermediate_size=inter, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    if family == "llama3":  # Llama 3.x's rope scaling
        shape["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    if family in ("mistral", "phi3"):
        shape.update(sliding_window=window, tie_word_embeddings=False)  # a window shorter than the prompts
    if family in ("gemma2", "gemma3"):  # a local layer (window 16, Gemma 3: its own rotary base) and a global one
        shape.update(head_dim=64, query_pre_attn_scalar=48, sliding_window=window or 16,
                     layer_types=["sliding_attention", "full_attention"])
    config, cls = {"qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM), "mistral": (t.MistralConfig, t.MistralForCausalLM),
                   "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM), "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
                   "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM), "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM)
                   }.get(family, (t.LlamaConfig, t.LlamaForCausalLM))
    model = cls(config(**shape))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.6 if p.dim() == 1 else 0.08) + (1.0 if p.dim() == 1 else 0.0))
    return _save(model, folder)


def _prompts(decoder, n: int) -> list[list[int]]:
    return [decoder.prompts.chat_ids([{"role": "user", "content": q["turns"][0]}])
            for q in load_prompts("spec_bench")[2: 2 + 4 * n: 4]]


def _tr_equals_ar(d: Decoder, n: int, tokens: int) -> None:
    for ids in _prompts(d, n):
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=tokens, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=tokens, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids


def _same_or_near_tie(ours: list[int], ref: list[int], logits) -> None:
    """ours == transformers' greedy ids, except where the reference itself is a near-tie (its last bits
    differ from ours)."""
    if ours != ref:
        p = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        top2 = logits[p].float().topk(2).values
        assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, (p, ours[p:p + 3], ref[p:p + 3])


def _reference(folder, fmt: str, store):
    """Transformers' own model (stock, float32) of the checkpoint with every linear weight replaced by
    the float32 weight its blocks rebuild: what the exact arithmetic must compute."""
    stock = load_model(ModelConfig(source=str(folder), kernels="stock", quantize="none"))
    weights = CheckpointWeights(folder, stock.model, fmt, store)
    with torch.no_grad():
        for name, m in stock.model.named_modules():
            if isinstance(m, torch.nn.Linear):
                b = weights.blocks(f"{name}.weight", m.out_features, m.in_features)
                m.weight = torch.nn.Parameter(rebuild(b).clone())  # untied: the head has its own blocks
    return stock


def test_the_bundled_models_bf16_checkpoint_runs_quantized_on_the_native_forward(bundled_bf16, tmp_path,
                                                                                  monkeypatch) -> None:
    config = ModelConfig(source=str(bundled_bf16), cache_dir=str(tmp_path))  # auto: q8_0, exact (docs/kernels.md)
    d = Decoder(DecoderConfig(model=config))
    loaded = d.loaded
    assert (loaded.kernels, loaded.forward, loaded.arithmetic, loaded.quantize) == \
        ("compressed", "native", "exact", "q8_0")
    _tr_equals_ar(d, 3, 32)
    stored = sorted((tmp_path / "quantized").glob("q8_0-*/*.npz"))
    assert len(stored) == 211  # every linear layer, the tied head included
    before = {p: p.stat().st_mtime_ns for p in stored}

    def refuse(*_):
        raise AssertionError("a cached layer was quantized again")
    monkeypatch.setattr(checkpoint, "_quantize", refuse)
    again = load_model(config)  # read back from the cache: nothing quantized, nothing rewritten
    assert again.forward == "native" and {p: p.stat().st_mtime_ns for p in stored} == before


@pytest.mark.parametrize("family, fmt, window", [("llama", "q4_k", None), ("qwen2", "q6_k", None),
                                                 ("llama3", "q8_0", None), ("mistral", "q4_k", None),
                                                 ("mistral", "q8_0", 16), ("qwen3", "q8_0", None)])
def test_exact_equals_transformers_on_the_quantized_weights(tmp_path, family, fmt, window) -> None:
    folder = _tiny(tmp_path / "ckpt", family, window)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize=fmt, arithmetic="exact",
                                                cache_dir=str(tmp_path / "cache"))))
    assert (d.loaded.forward, d.loaded.arithmetic, d.loaded.quantize) == ("native", "exact", fmt)
    kinds = {layer_type(fmt, 256, False), layer_type(fmt, 640, False), layer_type(fmt, 256, True)}
    assert kinds == {"q4_k": {"Q4_K", "Q5_0", "Q6_K"}, "q6_k": {"Q6_K", "Q8_0"}, "q8_0": {"Q8_0"}}[fmt]
    store = next((tmp_path / "cache" / "quantized").glob(f"{fmt}-*"))
    stock = _reference(folder, fmt, store)
    for ids in _prompts(d, 2):
        ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True)).ids
        ref, logits = _generate(stock, ids, 24)
        _same_or_near_tie(ours, ref, logits)
    _tr_equals_ar(d, 2, 24)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # q, k, v biases from the checkpoint; q/k norms
def test_int8_on_a_quantized_checkpoint_keeps_tr_equal_to_ar(tmp_path, family) -> None:
    folder = _tiny(tmp_path / "ckpt", family)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q4_k", arithmetic="int8",
                                                cache_dir=str(tmp_path))))
    assert (d.loaded.forward, d.loaded.arithmetic) == ("native", "int8")
    _tr_equals_ar(d, 2, 24)


def test_exact_blocks_are_kept_not_quantized_again(tmp_path) -> None:
    """The bundled model's float32 checkpoint holds exact Q4_1 blocks: quantize q4_k keeps them (kind 4),
    so it decodes as the bundled model does, token for token."""
    folder = builtin_model_dir()
    ours = load_model(ModelConfig(source=str(folder), quantize="q4_k", arithmetic="exact", cache_dir=str(tmp_path)))
    assert ours.quantize == "q4_k" and ours.forward == "native"
    kinds = {m.kind for m in ours.model.modules() if hasattr(m, "kind")}
    assert kinds <= {4, 8}  # recovered Q4_1 and Q8_0 blocks (the bundled file's): nothing re-quantized
    d = Decoder(DecoderConfig(model=ModelConfig(arithmetic="exact")))
    mine = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q4_k", arithmetic="exact",
                                                   cache_dir=str(tmp_path))))
    for ids in _prompts(d, 2):
        a = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True)).ids
        b = mine.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True)).ids
        assert a == b


def test_quantize_none_keeps_float_weights_and_bad_names_are_refused(bundled_bf16, tmp_path) -> None:
    loaded = load_model(ModelConfig(source=str(bundled_bf16), quantize="none", cache_dir=str(tmp_path)))
    assert loaded.quantize == "none" and loaded.forward == "transformers" and "compressed" not in loaded.kernels
    with pytest.raises(ValueError, match="quantize must be one of"):
        ModelConfig(source=str(bundled_bf16), quantize="q3_k")


@pytest.mark.parametrize("window", [None, 16])  # Phi-3-mini's configs carry one (2047): Mistral's function
def test_a_phi3_checkpoint_is_split_into_the_llama_it_computes(tmp_path, window) -> None:
    """Phi-3's fused q/k/v and gate/up weights are split at load (phi3.as_llama): the model takes the
    native forward, and its exact arithmetic equals transformers' own Phi-3 on the same rebuilt weights."""
    folder = _tiny(tmp_path / "ckpt", "phi3", window)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="exact",
                                                cache_dir=str(tmp_path / "cache"))))
    assert type(d.loaded.model).__name__ == ("MistralForCausalLM" if window else "LlamaForCausalLM")
    assert d.loaded.forward == "native"
    assert d.loaded.fingerprint == model_spec_of(ModelConfig(source=str(folder)), 8).fingerprint  # as phi3's
    assert d.loaded.fingerprint.startswith("phi3-")
    store = next((tmp_path / "cache" / "quantized").glob("q8_0-*"))

    def rebuilt(name):
        with np.load(store / f"{name}.npz") as z:
            return rebuild((int(z["kind"]), z["codes"], z["d"], z["m"] if "m" in z else None))
    stock = load_model(ModelConfig(source=str(folder), kernels="stock", quantize="none"))
    with torch.no_grad():
        for name, m in stock.model.named_modules():
            parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            if isinstance(m, torch.nn.Linear):
                stem, _, leaf = name.rpartition(".")
                w = torch.cat([rebuilt(f"{stem}.{p}.weight") for p in parts[leaf]]) if leaf in parts else \
                    rebuilt(f"{name}.weight")
                m.weight = torch.nn.Parameter(w.clone())
    for ids in _prompts(d, 2):
        ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True)).ids
        ref, logits = _generate(stock, ids, 24)
        _same_or_near_tie(ours, ref, logits)
    _tr_equals_ar(d, 2, 24)


def test_an_unreadable_cached_layer_is_quantized_again(tmp_path) -> None:
    folder = _tiny(tmp_path / "ckpt", "llama")
    config = ModelConfig(source=str(folder), quantize="q8_0", cache_dir=str(tmp_path / "cache"))
    first = load_model(config)
    store = next((tmp_path / "cache" / "quantized").glob("q8_0-*"))
    (store / "model.layers.0.mlp.down_proj.weight.npz").write_bytes(b"not a zip")  # a damaged cache file
    again = load_model(config)
    with np.load(store / "model.layers.0.mlp.down_proj.weight.npz") as z:  # rewritten whole
        assert int(z["kind"]) == 8
    a, b = first.model.model.layers[0].mlp.down_proj, again.model.model.layers[0].mlp.down_proj
    assert torch.equal(a.codes, b.codes) and torch.equal(a.d, b.d)


def test_int8_calibrations_of_another_model_with_the_same_fingerprint_are_not_read(tmp_path) -> None:
    """The fingerprint (vocabulary, family, hidden size, layers) does not tell these two apart (MLP 1024 and
    256): the second must calibrate its own kept inputs, not read the first's (a dim of 604 in a layer
    of 512 inputs stopped a load in CI)."""
    cache = str(tmp_path / "cache")
    for inter in (1024, 256):
        folder = _tiny(tmp_path / f"ckpt{inter}", "llama", inter=inter)
        loaded = load_model(ModelConfig(source=str(folder), quantize="q8_0", arithmetic="int8", cache_dir=cache))
        down = loaded.model.model.layers[0].mlp.down_proj
        assert down.in_features == inter and int(down.kept.max()) < inter
