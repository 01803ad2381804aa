"""llama.cpp's rotary frequency factors (`rope_freqs.weight`), as a GGUF file of Llama 3.1+ holds them.

llama.cpp's converter (convert_hf_to_gguf.py) writes no rope-scaling keys for Llama 3.x's "llama3" rope
scaling: it writes the scaling out as one float32 factor per rotary frequency (head_dim / 2 of them: 1
for the high frequencies, the scaling factor for the low ones, a blend between), and llama.cpp divides
each frequency's angle by its factor. transformers' GGUF reader maps no such tensor, so a model it
builds from the file turns every key and query with the unscaled frequencies (at every position: the
low frequencies differ by up to the factor, 8 for Llama 3.1). Here the file's factors ride on the
config (`rope_freq_factors`, which a converted checkpoint's config.json keeps) and every rotary
embedding's frequencies are divided by them once, whichever path built the model:

    inv_freq[i] = base ** (-2i / D) / factors[i]      (float32, as transformers' table, then the division)

so transformers' forward on the file (the conversion path, the tests' reference) and the native forward
(whose tables transformers' rotary module computes) both take the file's scaling. transformers' own
llama3 scaling computes the blended band as a product rather than this quotient: the two frequencies
agree to a float32 rounding (tests/engine/model/test_converted_files.py).
"""

from __future__ import annotations

import struct
from math import prod
from pathlib import Path

import torch

from ...core.errors import FailedPrecondition

TENSOR = "rope_freqs.weight"
_F32 = 0  # ggml's type id of float32


def file_rope_factors(path: Path, meta: dict, tensor: str = TENSOR) -> list[float] | None:
    """The file's per-frequency rotary factors (float32 tensor `tensor`: Llama 3.x's `rope_freqs.weight`,
    or Phi-3's longrope lists, gguf_phi3.py), or None where it holds no such tensor."""
    from transformers.integrations.gguf import reader

    blob = reader._mapped(str(path))
    _, count, pos = reader._read_metadata(blob, str(path), ())
    entries, end = reader._read_tensor_table(blob, count, pos)
    found = next((e for e in entries if e[0] == tensor), None)
    if found is None:
        return None
    _, shape, ggml_type, offset = found
    if ggml_type != _F32:
        raise FailedPrecondition(f"{path.name}: {tensor} is ggml type {ggml_type}; llama.cpp's converter writes "
                                 "it as float32, which this server reads")
    align = int(meta.get("general.alignment", 32))
    start = -(-end // align) * align + offset
    n = prod(shape)
    return [float(v) for v in struct.unpack_from(f"<{n}f", blob, start)]


def apply_rope_factors(model) -> int:
    """Divide each rotary embedding's frequencies (and the copy dynamic rope types restore from) by the
    model's `config.rope_freq_factors`, once; how many modules it changed (0: no factors)."""
    factors = getattr(model.config, "rope_freq_factors", None)
    if not factors:
        return 0
    f = torch.tensor(factors, dtype=torch.float32)
    changed = 0
    for module in model.modules():
        inv = getattr(module, "inv_freq", None)
        if not isinstance(inv, torch.Tensor) or getattr(module, "rope_factored", False):
            continue
        if inv.shape != f.shape:
            raise FailedPrecondition(f"the file's {TENSOR} holds {f.numel()} factors; the model's rotary "
                                     f"embedding turns {inv.numel()} frequencies")
        module.inv_freq = inv.to(torch.float32) / f.to(inv.device)
        if isinstance(getattr(module, "original_inv_freq", None), torch.Tensor):
            module.original_inv_freq = module.inv_freq.clone()
        module.rope_factored = True
        changed += 1
    return changed
