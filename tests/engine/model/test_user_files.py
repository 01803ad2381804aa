"""The files users bring (issue 55), made here from the bundled model with gguf-py (no download, no
llama.cpp build): the bundled model re-quantized to Q4_0, Q5_0, and the K-quant mixes Q4_K_M, Q5_K_M
and Q6_K (engine/model/kernels/kencode.py; rows of 576 take llama-quantize's fallbacks) reaches the
compressed kernels and the native forward in every layer (Q4_0 fell to float32 in 210 of 211 before,
Q4_K_M in 196), its exact arithmetic equals transformers' greedy decoding on the same file's
dequantized weights, and TR equals plain decoding token for token in both arithmetics."""

from __future__ import annotations

import pytest
import torch

from trserve.engine import Decoder, DecoderConfig, GenerationRequest
from trserve.engine.model.kernels.build import qlinear_supported
from trserve.engine.model.loader import ModelConfig, load_model
from tests.conftest import load_prompts
from tests.engine.test_lossless import NEAR_TIE_EPS, _generate

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bundled model re-quantized, by type (made once for the module)."""
    from trserve.bench.requant import requantize
    from trserve.bench.runner import _bundled_gguf

    folder, made = tmp_path_factory.mktemp("files"), {}

    halves = {f"blk.{i}.ffn_down.": "Q6_K" for i in range(0, 30, 2)}  # as llama-quantize's _M mixes do
    recipes = {"mixed": ("Q4_0", {"ffn_down": "F16"}),  # float16 down projections: no block form
               "Q4_K_M": ("Q4_K", halves), "Q5_K_M": ("Q5_K", halves)}

    def get(qtype: str):
        if qtype not in made:
            main, others = recipes.get(qtype, (qtype, None))
            made[qtype] = requantize(_bundled_gguf(), folder / f"smollm2-{qtype.lower()}.gguf", main, others)
        return made[qtype]
    return get


def _prompts(decoder, n: int = 4) -> list[list[int]]:
    return [decoder.prompts.chat_ids([{"role": "user", "content": q["turns"][0]}])
            for q in load_prompts("spec_bench")[1: 1 + 4 * n: 4]]


@pytest.mark.parametrize("qtype, arithmetic", [("Q4_0", "exact"), ("Q4_0", "int8"), ("Q5_0", "int8"),
                                               ("Q4_K_M", "exact"), ("Q4_K_M", "int8")])  # Q5_K_M, Q6_K: the tiny model's
def test_a_file_runs_on_the_kernels_and_tr_equals_ar(files, qtype, arithmetic) -> None:
    path = files(qtype)
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic=arithmetic)))
    loaded = d.loaded
    assert loaded.kernels == "compressed" and loaded.forward == "native" and loaded.arithmetic == arithmetic
    for ids in _prompts(d):
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=40, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=40, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids
    if arithmetic == "exact":  # transformers on the same file's weights, dequantized by gguf-py
        stock = load_model(ModelConfig(source=str(path), kernels="stock"))
        for ids in _prompts(d, 2):
            ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=40, mode="ar", ignore_eos=True)).ids
            ref, logits = _generate(stock, ids, 40)
            if ours != ref:  # only where the reference itself is a near-tie (its last bits differ from ours)
                p = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
                top2 = logits[p].float().topk(2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, (p, ours[p:p + 3], ref[p:p + 3])


def test_a_mixed_file_without_the_native_forward_stays_lossless(files) -> None:
    """Issue 55: a file with some layers in no block form the kernels take (here float16 down
    projections, as llama-quantize can leave them) cannot run the native forward; `auto` then takes the exact arithmetic, not int8,
    whose codes turned transformers' last-bit differences into other tokens (tr == ar 1/13 on a
    Q4_K_M file of the bundled model, 13/13 in exact)."""
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(files("mixed")))))
    loaded = d.loaded
    assert loaded.kernels == "compressed+packed" and loaded.forward == "transformers" and loaded.arithmetic == "exact"
    for ids in _prompts(d, 2):
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids


def test_a_file_is_read_as_it_is_without_a_float32_copy(files, tmp_path) -> None:
    """Issue 55: a GGUF's linear layers come from the memory-mapped file's blocks onto the kernels
    (engine/model/gguf_file.py): nothing converted into the cache, and the layers hold their block
    bytes (Q4_K at 0.578 bytes per weight: the file's two-level scales; Q5_0 at 0.69, its min implied; the 8-bit kinds about 1.06-1.25),
    not float32's 4."""
    import shutil

    from trserve.engine.model.kernels.qlinear import QLinear
    from trserve.engine.model.paths import default_cache_dir

    path = tmp_path / "read-as-it-is.gguf"  # a name of its own: no other test converts it
    shutil.copy(files("Q4_K_M"), path)
    loaded = load_model(ModelConfig(source=str(path)))
    assert loaded.kernels == "compressed" and loaded.forward == "native" and loaded.arithmetic == "int8"
    assert not list((default_cache_dir() / "models").glob("gguf-read-as-it-is-*"))
    layers = [m for m in loaded.model.modules() if isinstance(m, QLinear)]
    assert len(layers) == 211 and {m.kind for m in layers} == {6, 12, 20}  # Q4_K, its Q5_0 fallback, Q6_K
    held = sum(b.numel() * b.element_size() for m in layers for b in (m.codes, m.d, m.m))
    weights = sum(m.in_features * m.out_features for m in layers)
    assert held < 1.2 * weights, held / weights
    # the embedding stays the file's rows, each looked-up row exactly gguf-py's dequantized one
    import numpy as np
    from gguf import GGUFReader, quants

    from trserve.engine.model.embedding import FileEmbedding

    embed = loaded.model.get_input_embeddings()
    assert isinstance(embed, FileEmbedding) and not any(True for _ in embed.parameters())
    (tensor,) = [t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight"]
    table = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
    ids = torch.tensor([[0, 1, 17], [49151, 1000, 17]])
    assert torch.equal(embed(ids), torch.from_numpy(table[ids.numpy()]))
    with pytest.raises(IndexError):
        embed(torch.tensor([49152]))


def test_a_file_with_a_type_the_kernels_do_not_take_is_refused_in_one_line(tmp_path) -> None:
    from trserve.bench.requant import requantize
    from trserve.bench.runner import _bundled_gguf
    from trserve.core.errors import FailedPrecondition

    path = requantize(_bundled_gguf(), tmp_path / "ternary.gguf", "Q4_0", {"blk.3.ffn_down.": "TQ2_0"})
    with pytest.raises(FailedPrecondition, match=r"tensor blk\.3\.ffn_down\.weight is TQ2_0: .*Q4_K"):
        load_model(ModelConfig(source=str(path)))


def test_float_linears_of_a_file_run_in_float32_beside_the_blocks(tmp_path) -> None:
    """BF16 down projections (left unquantized by llama-quantize's --tensor-type): the exact arithmetic
    under auto, transformers' modules, and TR still equals plain decoding."""
    from trserve.bench.requant import requantize
    from trserve.bench.runner import _bundled_gguf

    path = requantize(_bundled_gguf(), tmp_path / "bf16-down.gguf", "Q4_K", {"ffn_down": "BF16"})
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path))))
    assert d.loaded.kernels == "compressed+packed" and d.loaded.arithmetic == "exact"
    for ids in _prompts(d, 1):
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=24, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids


@pytest.mark.parametrize("mix, arithmetic", [("Q4_K_M", "exact"), ("Q4_K_M", "int8"), ("Q5_K_M", "int8"),
                                             ("Q6_K", "exact")])
def test_a_tiny_model_all_in_k_quants(tmp_path, mix, arithmetic) -> None:
    """A random Llama of a tiny shape whose every linear takes K-quant super-blocks (no fallback types)
    and 4 query heads on 2 KV heads (the q/k row order transformers undoes): every layer on the kernels
    and the native forward, TR == AR; in the exact arithmetic, transformers' greedy decoding on the same
    file's dequantized weights."""
    from trserve.bench.shaped import make_shaped

    path = make_shaped("tiny", mix, tmp_path / f"tiny-{mix}.gguf")
    d = Decoder(DecoderConfig(model=ModelConfig(source=str(path), arithmetic=arithmetic)))
    assert d.loaded.kernels == "compressed" and d.loaded.forward == "native" and d.loaded.arithmetic == arithmetic
    prompts = _prompts(d, 2)
    for ids in prompts:
        ar = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="ar", ignore_eos=True))
        tr = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="tr", ignore_eos=True))
        assert tr.ids == ar.ids
    if arithmetic == "exact":
        stock = load_model(ModelConfig(source=str(path), kernels="stock", cache_dir=str(tmp_path / "cache")))
        for ids in prompts:
            ours = d.generate(GenerationRequest(input_ids=ids, max_new_tokens=32, mode="ar", ignore_eos=True)).ids
            ref, logits = _generate(stock, ids, 32)
            if ours != ref:
                p = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
                top2 = logits[p].float().topk(2).values
                assert float(top2[0] - top2[1]) < NEAR_TIE_EPS, (p, ours[p:p + 3], ref[p:p + 3])


def test_the_conversion_path_finds_every_layers_blocks_in_transformers_row_order(tmp_path) -> None:
    """Where a GGUF takes the conversion (here: the stock model transformers loads), gguf_file.file_blocks
    maps each linear layer to the file's blocks through transformers' own name map and q/k row order
    (4 query heads on 2 KV heads) and keeps only blocks that rebuild the loaded weight bit for bit."""
    from trserve.bench.shaped import make_shaped
    from trserve.engine.model.gguf_file import file_blocks

    path = make_shaped("tiny", "Q4_K_M", tmp_path / "tiny.gguf")
    stock = load_model(ModelConfig(source=str(path), kernels="stock", cache_dir=str(tmp_path / "cache")))
    linears = [n for n, m in stock.model.named_modules() if isinstance(m, torch.nn.Linear)]
    blocks = file_blocks(str(path), stock.model)
    assert sorted(blocks) == sorted(linears) and len(linears) == 15
    assert {b[0] for b in blocks.values()} == {6, 20}
