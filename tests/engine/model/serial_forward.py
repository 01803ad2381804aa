"""Tree verification: one forward of the unmodified model over root + drafted nodes."""

from __future__ import annotations

import torch

from tests.engine.model.serial_kv import KVCache
from trserve.engine.tr.tree import CompiledTree


def verify_tree(model, cache: KVCache, tokens: torch.Tensor, tree: CompiledTree) -> torch.Tensor:
    """Logits of every node given the cached context and the node's ancestors.

    tokens: [n] (root first, not yet in the cache) -> logits: [n, V]; appends n entries to `cache`.
    The mask is additive float [1, 1, n, past + n]: 0 = visible, dtype-min = hidden (a bool mask
    silently gives wrong logits with eager attention). Positions are past + depth, so every path
    sees the same positions it would in plain decoding.
    """
    n = tree.n
    past = len(cache)
    context = torch.zeros(n, past, dtype=tree.mask.dtype, device=tokens.device)
    mask = torch.cat([context, tree.mask], dim=1)[None, None]  # [1, 1, n, past + n]
    positions = (tree.depth + past)[None]  # [1, n]
    out = model(input_ids=tokens[None], attention_mask=mask, position_ids=positions,
                past_key_values=cache.cache, use_cache=True)
    return out.logits[0]


def forward_one(model, cache: KVCache, token: int) -> torch.Tensor:
    """Plain decoding step: logits [V] of one token appended to the cache."""
    device = model.device
    x = torch.tensor([[token]], device=device)
    positions = torch.tensor([[len(cache)]], device=device)
    return model(input_ids=x, position_ids=positions, past_key_values=cache.cache, use_cache=True).logits[0, -1]
