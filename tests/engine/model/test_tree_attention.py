"""Tree verification through the unmodified transformers model equals per-path causal decoding."""

import pytest
import torch

from tests.engine.model.serial_forward import forward_one, verify_tree
from tests.engine.model.serial_kv import KVCache
from trserve.engine.model.packed import pack_linears
from trserve.engine.model.kernels.qlinear import quantize_linears
from trserve.engine.tr.tree import compile_tree, load_template
from tests.conftest import tiny_llama
from tests.engine.model.test_qlinear import KERNELS_RUN, q4_weights


def _prefilled(model, seed: int, context_len: int):
    """The paper tree, a random context already in a fresh KV cache, and random node tokens."""
    tree = compile_tree(load_template("paper"))
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 128, (context_len,), generator=g).tolist()
    tokens = torch.randint(0, 128, (tree.n,), generator=g)
    cache = KVCache(model.config)
    model(input_ids=torch.tensor([context]), past_key_values=cache.cache, use_cache=True)
    return tree, context, tokens, cache


def causal_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kernels", ["stock", "packed", "compressed"])
@torch.inference_mode()
def test_tree_logits_equal_per_path_causal_logits(attn, kernels, tmp_path):
    model = tiny_llama(attn=attn)
    if kernels == "packed":
        pack_linears(model)
    elif kernels == "compressed":
        if not KERNELS_RUN:
            pytest.skip("compressed kernels need x86-64 Linux and a C compiler")
        for i, lin in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            lin.weight.data = q4_weights(*lin.weight.shape, seed=i)
        assert quantize_linears(model, tmp_path)[1] == 0
    tree, context, tokens, cache = _prefilled(model, seed=1, context_len=9)
    logits = verify_tree(model, cache, tokens, tree)
    assert logits.shape == (tree.n, 128) and len(cache) == 9 + tree.n
    for node in [0, 1, 7, 8, 30, 60, tree.n - 1]:
        path = tokens[tree.path_to(node)].tolist()
        torch.testing.assert_close(logits[node], causal_last_logits(model, context + path), atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_compaction_keeps_exactly_the_accepted_path():
    model = tiny_llama()
    tree, context, tokens, cache = _prefilled(model, seed=2, context_len=6)
    verify_tree(model, cache, tokens, tree)
    path = tree.path_to(tree.n - 2)  # a deep, non-contiguous path
    assert path != list(range(len(path)))
    cache.compact(len(context), path)
    assert len(cache) == len(context) + len(path)
    nxt = 17
    expected = causal_last_logits(model, context + tokens[path].tolist() + [nxt])
    torch.testing.assert_close(forward_one(model, cache, nxt), expected, atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_grafted_lookup_chain_sees_its_stem_and_chain_only():
    from trserve.engine.drafting.hybrid import attach_chain

    model = tiny_llama()
    base, context, tokens, cache = _prefilled(model, seed=3, context_len=7)
    at = base.path_to(base.n - 1)[-2]  # a node at depth >= 2, not on the first-ranked spine
    tree = attach_chain(base, at, 5)
    chain = torch.randint(0, 128, (5,), generator=torch.Generator().manual_seed(4))
    logits = verify_tree(model, cache, torch.cat([tokens, chain]), tree)
    all_tokens = torch.cat([tokens, chain])
    for node in [1, base.n - 1, base.n, base.n + 2, base.n + 4]:
        path = all_tokens[tree.path_to(node)].tolist()
        torch.testing.assert_close(logits[node], causal_last_logits(model, context + path), atol=2e-4, rtol=1e-4)


@torch.inference_mode()
def test_grouped_sdpa_gives_the_stock_tree_logits_without_repeating_kv(monkeypatch):
    """engine/model/attention.py: query heads folded per KV head == transformers' repeat_kv path (float rounding)."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    from trserve.engine.model.attention import NAME, use_grouped_sdpa

    model = tiny_llama()  # 4 query heads over 2 KV heads
    tree, context, tokens, cache = _prefilled(model, seed=4, context_len=11)
    stock = verify_tree(model, cache, tokens, tree)
    assert use_grouped_sdpa(model) and model.config._attn_implementation == NAME
    repeats = []
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: repeats.append(1) or pytest.fail("KV repeated"))
    _, _, _, cache2 = _prefilled(model, seed=4, context_len=11)
    grouped = verify_tree(model, cache2, tokens, tree)
    assert not repeats
    torch.testing.assert_close(grouped, stock, atol=1e-5, rtol=1e-5)  # rows batched differently: float rounding
    torch.testing.assert_close(forward_one(model, cache2, 3), forward_one(model, cache, 3), atol=1e-5, rtol=1e-5)


def test_attention_in_use_names_grouped_sdpa_once_it_is_registered():
    from trserve.engine.model.attention import attention_in_use, use_grouped_sdpa

    assert attention_in_use(tiny_llama(attn="eager")) == "eager"
    model = tiny_llama()
    assert attention_in_use(model) == "sdpa"
    assert use_grouped_sdpa(model) and attention_in_use(model) == "grouped_sdpa"
