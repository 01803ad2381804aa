"""KV cache wrapper: append by forward, then keep only the root + accepted path of a tree step."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.errors import InvalidArgument


class KVCache:
    """Owns a transformers DynamicCache; `compact` drops the rejected tree nodes after a step."""

    def __init__(self, model_config) -> None:
        self.cache = DynamicCache(config=model_config)
        kinds = {type(layer).__name__ for layer in self.cache.layers if not isinstance(layer, DynamicLayer)}
        if kinds:
            # Sliding-window layers keep only a window; compaction by absolute index would corrupt them.
            raise InvalidArgument(f"tree decoding needs full-attention KV layers; this model uses {sorted(kinds)}")

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def compact(self, start: int, keep: list[int]) -> None:
        """Entries [start, end) came from one tree forward; keep those at offsets `keep` (ascending).

        keys/values: [B, H, S, D] per layer -> [B, H, start + len(keep), D].
        Example: start=10, keep=[0, 2, 5] moves entries 10, 12, 15 to 10, 11, 12 and truncates at 13.
        """
        m = len(keep)
        contiguous = keep == list(range(m))
        idx = None if contiguous else torch.tensor(keep, device=self.cache.layers[0].keys.device) + start
        for layer in self.cache.layers:
            if idx is not None:
                layer.keys[:, :, start : start + m] = layer.keys[:, :, idx]
                layer.values[:, :, start : start + m] = layer.values[:, :, idx]
            layer.keys = layer.keys[:, :, : start + m]
            layer.values = layer.values[:, :, : start + m]
