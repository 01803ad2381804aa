"""A Phi-3 GGUF file (llama.cpp's `phi3` architecture) served as it is, as the Llama it computes.

llama.cpp's converter writes Phi-3's fused weights as they are: `attn_qkv` (q, k, v rows one after the
other) and `ffn_up` (gate rows, then up rows). The checkpoint loader already splits a Phi-3 checkpoint into
a Llama (engine/model/phi3.py:as_llama); a file is split the same way, each part a row range of the
fused tensor's blocks (blocks are per row), so it takes the compressed kernels and the native forward
without a float32 copy.

transformers' GGUF map reads a phi3 file's shape and rope base only. The rest of the checkpoint's config
is rebuilt here from what the converter wrote (`phi3_config`), for this path and the conversion path
alike (both build from engine/model/gguf_file.py:file_config):
- longrope (Phi-3.5-mini, Phi-4-mini): `rope_factors_short.weight` / `rope_factors_long.weight` (float32,
  the checkpoint's lists rounded as transformers rounds them), `rope.scaling.original_context_length`,
  and the context length: the checkpoint's rope parameters, so transformers derives the same attention
  factor (`rope.scaling.attn_factor` is checked against it). As for the checkpoint, the server then
  serves up to the original context, where every forward takes the short factors
  (engine/model/native.py:rope_positions).
- partial rotary (Phi-4-mini): `rope.dimension_count` rotary dims of each head's.
- the sliding window `attention.sliding_window` (Phi-3-mini-4k: 2047), applied as transformers applies
  the checkpoint's. llama.cpp reads it and switches it off ("Phi SWA is currently disabled",
  src/models/phi3.cpp): past the window this server's output on a phi3 file is the checkpoint's, not
  llama.cpp's.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...core.errors import FailedPrecondition
from .rope_factors import file_rope_factors

SHORT, LONG = "rope_factors_short.weight", "rope_factors_long.weight"


def phi3_config(config, meta: dict, path: Path):
    """transformers' Phi3Config of phi3 file `path` (metadata `meta`) with the checkpoint's rope (longrope,
    partial rotary) and sliding window rebuilt from the file."""
    value = meta.get
    out: dict = {}
    window = value("phi3.attention.sliding_window")
    if window:
        out["sliding_window"] = int(window)
    head_dim = config.hidden_size // config.num_attention_heads
    rot = int(value("phi3.rope.dimension_count") or head_dim)
    rope = {"rope_type": "default", "rope_theta": float(value("phi3.rope.freq_base", 10000.0))}
    short, long_ = file_rope_factors(path, meta, SHORT), file_rope_factors(path, meta, LONG)
    if short or long_:
        if not (short and long_) or len(short) != len(long_) or 2 * len(short) != rot:
            raise FailedPrecondition(f"{path.name}: longrope factors {len(short or [])} short and {len(long_ or [])} "
                                     f"long for {rot} rotary dims")
        orig = int(value("phi3.rope.scaling.original_context_length") or config.max_position_embeddings)
        rope.update(rope_type="longrope", short_factor=short, long_factor=long_, original_max_position_embeddings=orig)
        out["original_max_position_embeddings"] = orig
        _check_attention_factor(value("phi3.rope.scaling.attn_factor"), config.max_position_embeddings, orig, path)
    if rot != head_dim:
        rope["partial_rotary_factor"] = out["partial_rotary_factor"] = rot / head_dim
    return type(config).from_dict({**config.to_dict(), **out, "rope_parameters": rope})


def _check_attention_factor(written, context: int, orig: int, path: Path) -> None:
    """The converter's attention factor is transformers' for longrope (its float32 rounding); another one
    would be a model this config does not describe."""
    if written is None:
        return
    scale = context / orig
    derived = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    if abs(float(written) - derived) > 1e-6 * derived:
        raise FailedPrecondition(f"{path.name}: longrope attention factor {float(written)} where the context "
                                 f"lengths ({context} over {orig}) give {derived}: not served")
