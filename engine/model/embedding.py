"""A GGUF file's token embedding read as it is: rows dequantized when first looked up.

A float32 embedding table is vocab x hidden x 4 bytes (49,152 x 2,048 x 4 = 403 MB for a 1.7B Llama),
several times the file's own tensor (Q6_K: 83 MB), and text uses a small part of a vocabulary. Here
the table is allocated but left untouched (the system gives it pages as they are written), and a
lookup dequantizes each row the first time it is asked for, from the file's memory-mapped tensor
with gguf-py's own dequantization: each row is exactly the float32 row the whole table would hold
(a row's blocks depend on nothing else), so the model's arithmetic is unchanged bit for bit
(tests/engine/model/test_user_files.py). Gemma's embedding (a ScaledWordEmbedding) multiplies each row
by its embed_scale, sqrt(hidden) in float32, as transformers' module does. Resident memory grows with
the distinct tokens seen (about one page per row), at most to the float32 table it replaces; rows
come back at a lookup's cost.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FileEmbedding(nn.Module):
    """`nn.Embedding` over a GGUF tensor's rows. data: [num, row bytes] uint8 (a block type) or
    [num, dim] float16/bfloat16 as gguf-py's reader maps them; qtype: its GGMLQuantizationType.
    `table` [num, dim] float32 holds every row looked up so far (`ensure`); the others are unwritten."""

    def __init__(self, data: np.ndarray, qtype, num: int, dim: int, scale: float | None = None) -> None:
        super().__init__()
        if data.shape[0] != num:
            raise ValueError(f"embedding rows {data.shape[0]} != vocabulary {num}")
        self.data, self.qtype = data, qtype
        self.num_embeddings, self.embedding_dim = num, dim
        self.table = torch.empty(num, dim, dtype=torch.float32)  # pages are given as rows are written
        self.filled = torch.zeros(num, dtype=torch.bool)
        # Gemma's scaled embedding (its embed_scale: sqrt(hidden) as a float32 tensor, times each row
        # looked up); None: rows as they are
        self.embed_scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)

    def ensure(self, ids: torch.Tensor) -> None:
        """Rows `ids` (any shape) dequantized into `table` where they are not yet."""
        from gguf import quants

        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids must lie in [0, {self.num_embeddings}); got {int(flat.min())}..{int(flat.max())}")
        missing = ~self.filled[flat]
        if bool(missing.any()):
            new = flat[missing].unique()
            rows = quants.dequantize(np.ascontiguousarray(self.data[new.numpy()]), self.qtype)
            self.table[new] = torch.from_numpy(np.asarray(rows, dtype=np.float32).reshape(-1, self.embedding_dim))
            self.filled[new] = True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.ensure(ids)
        rows = self.table[ids]
        return rows if self.embed_scale is None else rows * self.embed_scale

    def extra_repr(self) -> str:
        scaled = "" if self.embed_scale is None else f", times {float(self.embed_scale):.6g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} rows dequantized when first looked up{scaled}"
