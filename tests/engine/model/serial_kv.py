"""KV cache wrapper: append by forward, then keep only the root + accepted path of a tree step."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from trserve.core.errors import InvalidArgument


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends into preallocated storage instead of concatenating.

    DynamicLayer re-allocates and copies the whole layer cache on every forward (torch.cat); here
    keys/values are views [B, H, len, D] of a buffer [B, H, capacity, D] that doubles when full, so a
    step copies only its new entries. Everything transformers reads (`keys`, `values`, the sequence
    length) behaves as in DynamicLayer.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None
        self._len = 0

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._kbuf is None else self._kbuf.shape[-2]
        if need <= cap:
            return
        cap = max(need, 2 * cap, 256)
        b, h, _, dk = like_k.shape
        kbuf = like_k.new_empty(b, h, cap, dk)
        vbuf = like_v.new_empty(b, h, cap, like_v.shape[-1])
        if self._len:
            kbuf[:, :, : self._len] = self._kbuf[:, :, : self._len]
            vbuf[:, :, : self._len] = self._vbuf[:, :, : self._len]
        self._kbuf, self._vbuf = kbuf, vbuf

    def _expose(self) -> None:
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(self._len + n, key_states, value_states)
        self._kbuf[:, :, self._len : self._len + n] = key_states
        self._vbuf[:, :, self._len : self._len + n] = value_states
        self._len += n
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def keep(self, start: int, idx: torch.Tensor | None, m: int) -> None:
        """Move entries start + idx to start..start + m (idx None: already in place), drop the rest."""
        if not self.is_initialized:
            return
        if idx is not None:
            self._kbuf[:, :, start : start + m] = self._kbuf[:, :, idx]
            self._vbuf[:, :, start : start + m] = self._vbuf[:, :, idx]
        self._len = start + m
        self._expose()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove and self.is_initialized:
            self.keep(0, None, max(0, self._len + tokens_to_remove))

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()


class KVCache:
    """Owns a transformers DynamicCache; `compact` drops the rejected tree nodes after a step."""

    def __init__(self, model_config) -> None:
        self.cache = DynamicCache(config=model_config)
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if kinds:
            # Sliding-window layers keep only a window; compaction by absolute index would corrupt them.
            raise InvalidArgument(f"tree decoding needs full-attention KV layers; this model uses {sorted(kinds)}")
        self.cache.layers = [GrowingLayer() for _ in self.cache.layers]

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def compact(self, start: int, keep: list[int]) -> None:
        """Entries [start, end) came from one tree forward; keep those at offsets `keep` (ascending).

        keys/values: [B, H, S, D] per layer -> [B, H, start + len(keep), D].
        Example: start=10, keep=[0, 2, 5] moves entries 10, 12, 15 to 10, 11, 12 and truncates at 13.
        """
        m = len(keep)
        contiguous = keep == list(range(m))
        idx = None
        if not contiguous:
            idx = torch.tensor(keep, device=self.cache.layers[0].keys.device) + start
        for layer in self.cache.layers:
            layer.keep(start, idx, m)
