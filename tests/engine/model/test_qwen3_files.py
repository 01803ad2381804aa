"""Qwen3 GGUF files (issue 57) read as they are (engine/model/gguf_file.py): a tiny random Qwen3 written
by bench/shaped.py as llama.cpp's convert_hf_to_gguf.py writes one (architecture `qwen3`, per-head
`attn_q_norm`/`attn_k_norm` weights far from 1, the head dim 64 in `qwen3.attention.key_length` where
hidden / heads is 32) takes the compressed kernels and the native forward; its exact arithmetic equals
transformers' Qwen3ForCausalLM on gguf-py's dequantized weights token for token, int8 keeps the
fidelity rule (docs/kernels.md) against those weights, and TR == AR in both."""

from __future__ import annotations

import pytest
import torch

from trserve.engine import Decoder, DecoderConfig, GenerationRequest
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.loader import ModelConfig, load_model
from tests.engine.model.test_user_files import _prompts
from tests.engine.test_lossless import NEAR_TIE_EPS, _generate

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from trserve.bench.shaped import make_shaped

    folder, made = tmp_path_factory.mktemp("qwen3"), {}

    def get(mix: str):
        if mix not in made:
            made[mix] = make_shaped("qwen3-tiny", mix, folder / f"qwen3-tiny-{mix}.gguf")
        return made[mix]
    return get


@pytest.fixture(scope="module")
def stock(files, tmp_path_factory):
    """transformers' own model of each file (the conversion path: gguf-py's dequantized weights)."""
    cache, made = tmp_path_factory.mktemp("cache"), {}

    def get(mix: str):
        if mix not in made:
            made[mix] = load_model(ModelConfig(source=str(files(mix)), kernels="stock", cache_dir=str(cache)))
        return made[mix]
    return get


def test_the_file_config_takes_the_head_dim_from_key_length(files, stock) -> None:
    """transformers' GGUF map reads no head dim for qwen3 (its config would keep Qwen3Config's 128)."""
    from transformers import AutoConfig, Qwen3ForCausalLM

    from trserve.engine.model.gguf_file import file_config

    path = files("Q4_K_M")
    assert AutoConfig.from_pretrained(path.parent, gguf_file=path.name).head_dim == 128  # what is fixed
    assert file_config(path).head_dim == 64
    model = stock("Q4_K_M").model
    assert isinstance(model, Qwen3ForCausalLM) and model.config.head_dim == 64
    assert model.model.layers[1].self_attn.q_norm.weight.shape == (64,)
    assert model.model.layers[1].self_attn.k_norm.weight.std() > 0.1  # the file's norms, not ones


@pytest.mark.parametrize("mix, arithmetic", [("Q4_K_M", "exact"), ("Q4_K_M", "int8"), ("Q8_0", "exact"),
                                             ("Q8_0", "int8")])
def test_a_qwen3_file_takes_the_native_forward_and_tr_equals_ar(files, stock, mix, arithmetic) -> None:
    from trserve.engine.model.kernels.qlinear import QLinear

    d = Decoder(DecoderConfig(model=ModelConfig(source=str(files(mix)), arithmetic=arithmetic)))
    loaded = d.loaded
    assert loaded.kernels == "compressed" and loaded.forward == "native" and loaded.arithmetic == arithmetic
    assert type(loaded.model).__name__ == "Qwen3ForCausalLM"
    assert sum(isinstance(m, QLinear) for m in loaded.model.modules()) == 15
    prompts = _prompts(d, 2)
    for ids in prompts:
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids
    if arithmetic != "exact":
        return
    for ids in prompts:  # transformers' Qwen3ForCausalLM on the file's dequantized weights
        ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="ar", ignore_eos=True)).ids
        ref, logits = _generate(stock(mix), ids, 32)
        if ours != ref:  # only where the reference itself is a near-tie (its last bits differ from ours)
            p = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            top2 = logits[p].float().topk(2).values
            assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, (p, ours[p:p + 3], ref[p:p + 3])


def test_int8_keeps_the_fidelity_rule_on_a_qwen3_file(files, stock) -> None:
    """Teacher-forced over transformers' greedy continuations of 4 prompts: int8 on the Q8_0 file within
    one point of bfloat16's top-1 agreement with the exact (dequantized float32) model, and at most 3x
    its mean KL (the rule docs/kernels.md holds formats to)."""
    import copy

    from trserve.bench.fidelity import compare, summarise, teacher_forced

    exact = stock("Q8_0")
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(files("Q8_0")), arithmetic="int8")))
    assert d.loaded.forward == "native" and d.loaded.arithmetic == "int8"
    bf16 = copy.deepcopy(exact.model).to(torch.bfloat16)
    parts = {"int8": [], "bf16": []}
    for ids in _prompts(d, 4):
        tokens, _ = _generate(exact, ids, 48)
        seq = ids + tokens
        want = teacher_forced(exact.model, seq, len(ids))
        for name, model in (("int8", d.loaded.model), ("bf16", bf16)):
            parts[name].append(compare(want, teacher_forced(model, seq, len(ids)), torch.tensor(tokens)))
    got, ref = summarise(parts["int8"]), summarise(parts["bf16"])
    assert got["top1_agreement"] >= ref["top1_agreement"] - 0.01, (got, ref)
    assert got["kl_mean"] <= 3 * max(ref["kl_mean"], 1e-6), (got, ref)
