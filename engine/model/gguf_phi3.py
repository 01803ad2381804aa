"""A Phi-3 GGUF file (llama.cpp's `phi3` architecture) served as it is, as the Llama it computes.

llama.cpp's converter writes Phi-3's fused weights as they are: `attn_qkv` (q, k, v rows one after the
other) and `ffn_up` (gate rows, then up rows). The checkpoint loader already splits a Phi-3 checkpoint into
a Llama (engine/model/phi3.py:as_llama); a file is split the same way, each part a row range of the
fused tensor's blocks (blocks are per row), so it takes the compressed kernels and the native forward
without a float32 copy. The file's `phi3.attention.sliding_window` (Phi-3-mini-4k: 2047) is applied, as
transformers' Phi-3 applies its checkpoint's and as this server applies it to that checkpoint; here in
the conversion path too, which builds from this config. transformers' GGUF map reads no window for
phi3, and llama.cpp reads it and switches it off ("Phi SWA is currently disabled", src/models/phi3.cpp):
past the window, this server's output on a phi3 file is the checkpoint's, not llama.cpp's.

Files served this way: full rotary and no longrope factors (Phi-3-mini-4k's kind). Phi-3.5-mini's and
Phi-4-mini's files hold `rope_factors_long/short.weight` (and Phi-4-mini partial rotary): those keep the
conversion path (transformers' Phi-3 modules), and their longrope factors are not read there either
(transformers' reader drops them): not served as llama.cpp runs them.
"""

from __future__ import annotations

LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


def phi3_file_kept(meta: dict, tensors: tuple[str, ...]) -> str | None:
    """Why a phi3 file keeps the conversion path (None: it is split into a Llama and read as it is)."""
    found = [t for t in LONGROPE if t in tensors]
    if found:
        return f"longrope factors ({', '.join(found)})"
    heads, hidden = meta.get("phi3.attention.head_count"), meta.get("phi3.embedding_length")
    rot = meta.get("phi3.rope.dimension_count")
    if heads and hidden and rot and int(rot) != int(hidden) // int(heads):
        return f"partial rotary ({rot} of {int(hidden) // int(heads)} dims)"
    return None


def phi3_config(config, meta: dict):
    """transformers' Phi3Config of a phi3 file with the file's sliding window (as the checkpoint's)."""
    window = meta.get("phi3.attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    return config
