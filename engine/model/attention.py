"""Tree attention without copying the KV cache for grouped-query models.

transformers' SDPA path handles a grouped-query model (fewer KV heads than query heads) without
copies only for a single query token; with several query tokens and a mask, as in tree
verification, it first repeats every layer's whole KV cache `groups` times (`repeat_kv`): at a KV
length of 1024 that is ~10 ms per forward of SmolLM2 on these CPUs, a third of a 4-token forward.

`grouped_sdpa` folds the query heads that share a KV head into the query length instead:
query [B, Hq, n, D] -> [B, Hkv, groups * n, D] (head j * groups + r, token i -> row r * n + i), the
[.., n, L] mask repeated per group, one SDPA call on the unrepeated KV, then back. Every query row
attends to the same keys with the same mask; only the batching of rows changes, as in transformers'
own single-token path (results agree to float rounding; bit for bit on SmolLM2 here). It is
registered with transformers' attention interface (the modeling code is untouched) and delegates
everything else to the stock SDPA path.
"""

from __future__ import annotations

import logging
import weakref

import torch

log = logging.getLogger("trserve.engine")
NAME = "trserve_sdpa"
_mask_memo: list = [None, 0, None]  # [weakref to the last mask, groups, its expansion]: one per forward


def with_attention(build):
    """`build(attn_implementation)` with "sdpa", or "eager" where the model's class refuses sdpa (Gemma 2
    in transformers: "does not support an attention implementation through ...scaled_dot_product_attention
    yet"): the model loads on what it supports instead of failing at start."""
    try:
        return build("sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e).lower():
            raise
        log.info("sdpa attention refused by this model (%s): eager attention", str(e).splitlines()[0][:120])
        return build("eager")


def _grouped_mask(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, 1, n, L] -> [b, 1, groups * n, L], row r * n + i = row i (cached for the layers of one forward)."""
    ref, g, out = _mask_memo
    if ref is not None and ref() is mask and g == groups:
        return out
    out = mask.repeat(1, 1, groups, 1)
    _mask_memo[:] = [weakref.ref(mask), groups, out]
    return out


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                 **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, hq, n, d = query.shape
    plain = (groups == 1 or n == 1 or attention_mask is None or attention_mask.dtype == torch.bool
             or attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or dropout
             or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    hkv = key.shape[1]
    q = query.reshape(b, hkv, groups * n, d)  # [b, Hkv, groups * n, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=_grouped_mask(attention_mask, groups), scale=scaling)  # [b, Hkv, groups * n, Dv]
    return out.reshape(b, hq, n, value.shape[-1]).transpose(1, 2).contiguous(), None  # [b, n, Hq, Dv]


def use_grouped_sdpa(model) -> bool:
    """Switch a loaded sdpa model to `grouped_sdpa`; False (nothing changed) where it does not apply."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", None)
    if not kv_heads or heads == kv_heads:
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
    return True


def attention_in_use(model) -> str:
    """'grouped_sdpa' once `use_grouped_sdpa` switched the model, else transformers' implementation name."""
    name = getattr(model.config, "_attn_implementation", None) or "eager"
    return "grouped_sdpa" if name == NAME else name
