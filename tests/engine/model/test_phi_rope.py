"""Phi-3.5-mini's and Phi-4-mini's rotary (issue 57): longrope (short and long factor lists, switched by
transformers per forward at original_max_position_embeddings) and, for Phi-4-mini, partial rotary
(partial_rotary_factor 0.75: the first 3/4 of each head rotated). Tiny random bf16 checkpoints of each
config, loaded through the checkpoint path (engine/model/checkpoint.py):
- Phi-3.5 (longrope, whole heads) is split into the Llama it computes and takes the native forward,
  whose table holds the short factors' rows; its exact arithmetic equals transformers' own Phi-3.
- Phi-4-mini (partial rotary, longrope) is split likewise, its rotary tables R = 48 of the head's 64
  dims wide (native.py passes R as tr_model.rotary_dim: csrc/forward.c turns pairs (i, i + R/2) and
  passes dims R.. through, as transformers' modeling_phi3.apply_rotary_pos_emb), and takes the native
  forward in both arithmetics; the split Llama's own modules apply Phi-3's partial rotary
  (engine/model/phi3.py:partial_attention). Asked for transformers' forward, it stays Phi-3.
Both serve up to original_max_position_embeddings, where every one of transformers' forwards takes
the short factors (engine/model/native.py:rope_positions), so TR == AR on both paths."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from trserve.core.errors import InvalidArgument
from trserve.engine import Decoder, DecoderConfig, GenerationRequest
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.kernels.kquants import rebuild
from trserve.engine.model.loader import ModelConfig, load_model
from trserve.engine.model.native import NativeForward
from tests.engine.model.test_checkpoint import _prompts, _same_or_near_tie, _save

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")

ORIGINAL = 192  # original_max_position_embeddings: the positions served


@pytest.fixture(scope="module")
def _kernels(tmp_path_factory):
    """One build of the compressed kernels for the module's tests (each test's cache_dir links to it)."""
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(autouse=True)
def _shared_kernels(tmp_path, _kernels):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(_kernels)


def _phi(folder, partial: float, **extra):
    """A random 2-layer Phi-3 (head dim 64) with longrope factors far apart (long = 4x short), and rotary
    on `partial` of each head, as a bfloat16 checkpoint (`extra`: other config fields)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    n = int(64 * partial) // 2
    short = [1.0 + 0.05 * i for i in range(n)]
    cfg = Phi3Config(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     original_max_position_embeddings=ORIGINAL, partial_rotary_factor=partial,
                     **{"tie_word_embeddings": False, **extra},
                     rope_scaling={"type": "longrope", "short_factor": short, "long_factor": [4 * x for x in short]})
    model = Phi3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.6 if p.dim() == 1 else 0.08) + (1.0 if p.dim() == 1 else 0.0))
    return _save(model, folder)


def _stock_on_rebuilt(folder, store):
    """transformers' own Phi-3 of the checkpoint, float32, each linear weight the one its blocks rebuild
    (the fused ones from their split parts where the load split them)."""
    stock = load_model(ModelConfig(source=str(folder), kernels="stock", quantize="none"))

    def rebuilt(name):
        with np.load(store / f"{name}.npz") as z:
            return rebuild((int(z["kind"]), z["codes"], z["d"], z["m"] if "m" in z else None))
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    with torch.no_grad():
        for name, m in stock.model.named_modules():
            if isinstance(m, torch.nn.Linear):
                stem, _, leaf = name.rpartition(".")
                split = leaf in parts and not (store / f"{name}.weight.npz").is_file()
                w = torch.cat([rebuilt(f"{stem}.{p}.weight") for p in parts[leaf]]) if split else rebuilt(f"{name}.weight")
                m.weight = torch.nn.Parameter(w.clone())
    return stock


def _decode_to_the_limit(d: Decoder, stock, n: int) -> None:
    """Each prompt decoded to the context's end (its tree's width left): TR == AR, and AR == transformers'
    greedy decoding (to float rounding: near-ties only)."""
    from tests.engine.test_lossless import _generate

    for ids in _prompts(d, n):
        new = d.max_context - len(ids) - 35  # the default tree's width reserved
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=new, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=new, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids and len(ar.ids) == new
        ref, logits = _generate(stock, ids, new)
        _same_or_near_tie(ar.ids, ref, logits)


def test_phi35_longrope_takes_the_native_forward_with_the_short_factors(tmp_path) -> None:
    folder = _phi(tmp_path / "phi35", 1.0)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="exact",
                                                cache_dir=str(tmp_path / "cache"))))
    assert type(d.loaded.model).__name__ == "LlamaForCausalLM" and d.loaded.forward == "native"
    assert d.loaded.model.config.rope_parameters["rope_type"] == "longrope"
    assert d.max_context == ORIGINAL and d.loaded.fingerprint.startswith("phi3-")
    stock = _stock_on_rebuilt(folder, next((tmp_path / "cache" / "quantized").glob("q8_0-*")))
    with torch.inference_mode():  # the native table: transformers' Phi-3 rows over the served positions
        native = NativeForward(d.loaded.model)
        pos = torch.arange(ORIGINAL)[None]
        cos, sin = stock.model.model.rotary_emb(torch.zeros(1), pos)
        table_cos, table_sin = native._tables[:2]  # [P, D] each (Gemma 3's local table would follow)
        assert table_cos.shape[0] == ORIGINAL and torch.equal(table_cos, cos[0]) and torch.equal(table_sin, sin[0])
        long_cos, _ = stock.model.model.rotary_emb(torch.zeros(1), torch.arange(ORIGINAL + 1)[None])
        assert not torch.allclose(long_cos[0, :ORIGINAL], cos[0], atol=1e-3)  # the factors do differ
        with pytest.raises(ValueError, match="past the 192 positions"):
            native._grow_rope(ORIGINAL + 1)
    _decode_to_the_limit(d, stock, 2)


def test_phi4_partial_rotary_takes_the_native_forward_and_equals_transformers_phi3(tmp_path, caplog) -> None:
    folder = _phi(tmp_path / "phi4", 0.75)
    with caplog.at_level(logging.INFO, logger="trserve.engine"):
        d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="exact",
                                                    cache_dir=str(tmp_path / "cache"))))
    loaded = d.loaded
    assert type(loaded.model).__name__ == "LlamaForCausalLM" and loaded.forward == "native"
    assert type(loaded.model.model.layers[0].self_attn).__name__ == "PartialRotaryLlamaAttention"
    assert "native forward not used" not in caplog.text and d.max_context == ORIGINAL
    stock = _stock_on_rebuilt(folder, next((tmp_path / "cache" / "quantized").glob("q8_0-*")))
    assert type(stock.model).__name__ == "Phi3ForCausalLM"
    native = d.engine.runner.native
    assert native.m.rotary_dim == 48 and native.head_dim == 64  # the first 3/4 of each head turned
    with torch.inference_mode():  # the native tables: transformers' Phi-3 rows, R = 48 columns
        cos, sin = stock.model.model.rotary_emb(torch.zeros(1), torch.arange(ORIGINAL)[None])
        assert cos.shape[-1] == 48 and torch.equal(native._tables[0], cos[0]) and torch.equal(native._tables[1], sin[0])
        ids = torch.tensor([list(range(300, 340))])
        ref = stock.model(ids).logits[0]
        split = loaded.model(ids).logits[0]  # transformers' forward of the split Llama (calibration's, the fallback's)
    assert (split - ref).abs().max() < 1e-3
    _decode_to_the_limit(d, stock, 3)


def test_phi4_partial_rotary_int8_tr_equals_ar_natively(tmp_path) -> None:
    # Phi-4-mini's own config ties the LM head to the embeddings and sets a sliding window (262144)
    folder = _phi(tmp_path / "phi4", 0.75, tie_word_embeddings=True, sliding_window=262144)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", arithmetic="int8",
                                                cache_dir=str(tmp_path / "cache"))))
    assert type(d.loaded.model.model.layers[0].self_attn).__name__ == "PartialRotaryMistralAttention"
    assert (d.loaded.forward, d.loaded.arithmetic, d.engine.runner.native.m.rotary_dim) == ("native", "int8", 48)
    for ids in _prompts(d, 3):
        new = d.max_context - len(ids) - 35  # to the context's end, the default tree's width reserved
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=new, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=new, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids and len(ar.ids) == new


def test_phi4_with_transformers_forward_asked_for_stays_phi3_and_lossless(tmp_path, caplog) -> None:
    folder = _phi(tmp_path / "phi4", 0.75)
    with caplog.at_level(logging.INFO, logger="trserve.engine"):
        d = Decoder(DecoderConfig(model=ModelConfig(source=str(folder), quantize="q8_0", forward="transformers",
                                                    cache_dir=str(tmp_path / "cache"))))
    loaded = d.loaded
    assert type(loaded.model).__name__ == "Phi3ForCausalLM"
    assert (loaded.kernels, loaded.forward, loaded.arithmetic) == ("compressed", "transformers", "exact")
    assert "kept with its fused layers, on transformers' modules: partial rotary (partial_rotary_factor 0.75) " \
           "with transformers' forward asked for" in caplog.text
    _decode_to_the_limit(d, _stock_on_rebuilt(folder, next((tmp_path / "cache" / "quantized").glob("q8_0-*"))), 1)


def test_partial_rotary_without_longrope_stays_phi3_and_says_why(tmp_path) -> None:
    from transformers import Phi3Config

    from trserve.engine.model.checkpoint import as_llama
    from trserve.engine.model.native import native_unsupported

    cfg = Phi3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, partial_rotary_factor=0.75)
    assert as_llama(cfg) == (cfg, {})  # transformers' Llama's default rope init ignores the factor
    with torch.device("meta"):
        from transformers import Phi3ForCausalLM
        model = Phi3ForCausalLM(cfg)
    assert native_unsupported(model) == "Phi-3 with fused q/k/v and gate/up (partial rotary " \
                                        "(partial_rotary_factor 0.75) without longrope)"


def test_a_longrope_model_serves_no_further_than_its_original_positions(tmp_path) -> None:
    folder = _phi(tmp_path / "phi35", 1.0)
    model = ModelConfig(source=str(folder), quantize="q8_0", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(InvalidArgument, match="max_context 1024 exceeds this longrope model's 192 positions"):
        Decoder(DecoderConfig(model=model, max_context=1024))
    d = Decoder(DecoderConfig(model=model, max_context=128))
    assert d.max_context == 128
    with pytest.raises(InvalidArgument, match="exceeds the model context"):
        d.generate(GenerationRequest(input_ids=list(range(10, 90)), max_new_tokens=20))
