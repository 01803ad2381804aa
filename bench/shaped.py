"""GGUF files of real models' shapes with random weights, for what the bundled 135M model cannot show
(a 1.7B's or a 7B's memory and forward times): `python -m trserve.bench.shaped smollm2-1.7b Q4_K_M DST`.

The bundled file's metadata (tokenizer, chat template) with the shape's hyperparameters; weights
normal(0, 0.02) per tensor, norms ones, encoded one tensor at a time (a 7B needs no float32 copy of
itself). Q4_K_M as llama-quantize mixes it: Q4_K, with Q6_K for the embedding/head and half the layers'
attn_v and ffn_down (the first half, a simplification of its rule). A Qwen3 shape is written as llama.cpp's
convert_hf_to_gguf.py writes Qwen3: architecture `qwen3`, `qwen3.attention.key_length`/`value_length` the
head dim (not hidden / heads there), per-head `attn_q_norm`/`attn_k_norm` weights (drawn near 1 here, so
that they matter), q and k rows unpermuted (NeoX rotary). A Gemma 2/3 shape as it writes Gemma's:
architecture `gemma2`/`gemma3`, every norm stored as 1 + w (drawn near 1 here) with the post-attention
and post-feedforward norms (and Gemma 3's q/k norms), the embedding tied, the sliding window and Gemma
2's soft-capping in the metadata (GEMMA_KEYS). Random weights decode nonsense,
so a TR run of them drafts little (MAT ~1): these files measure forwards, loading and memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, MLP, layers, heads, KV heads, head dim, llama.cpp's architecture (vocab: the bundled 49,152)
    "smollm2-1.7b": (2048, 8192, 24, 32, 32, 64, "llama"),
    "llama-7b": (4096, 11008, 32, 32, 32, 128, "llama"),
    "tiny": (256, 512, 2, 4, 2, 64, "llama"),  # the tests': every linear in super-blocks of 256, grouped-query attention
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, "qwen3"),
    "qwen3-tiny": (256, 512, 2, 8, 2, 64, "qwen3"),  # head dim 64, not 256 / 8: read from key_length
    "gemma3-1b": (1152, 6912, 26, 4, 1, 256, "gemma3"),  # its K-quants' 1152-wide rows fall back (FALLBACK)
    "gemma2-tiny": (256, 512, 2, 4, 2, 64, "gemma2"),  # a local layer, then a global one
    "gemma3-tiny": (256, 512, 6, 4, 2, 64, "gemma3"),  # five local layers, then a global one
}
# Gemma's metadata beyond the shape (convert_hf_to_gguf.py's Gemma2Model/Gemma3Model write these keys):
# the tests' tiny windows (16, shorter than their prompts) and a Gemma 2 attention cap low enough to bite
GEMMA_KEYS = {"gemma3-1b": {"attention.sliding_window": 512},
              "gemma2-tiny": {"attention.sliding_window": 16, "attn_logit_softcapping": 0.125,
                              "final_logit_softcapping": 30.0},
              "gemma3-tiny": {"attention.sliding_window": 16}}
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's, for rows not a multiple of 256
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"), "Q6_K": ("Q6_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"),
         "Q4_0": ("Q4_0", "Q4_0")}


def _encode(rows: np.ndarray, qtype: str) -> np.ndarray:
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from ..engine.model.kernels.kencode import ENCODERS

    return ENCODERS[qtype](rows) if qtype in ENCODERS else quants.quantize(rows, T[qtype])


def _layer_tensors(i: int, arch: str, shape: tuple, main: str, high: str) -> list[tuple[str, tuple, str]]:
    """Layer i's tensors (name, shape, type): "norm" a norm drawn near 1 (Qwen3's q/k norms; every Gemma
    norm, stored as 1 + w as convert_hf_to_gguf.py stores them), "F32" one of ones."""
    hidden, inter, layers, heads, kv, head_dim, _ = shape
    later, gemma = i >= layers // 2, arch.startswith("gemma")
    norm = "norm" if gemma else "F32"
    out = [(f"blk.{i}.attn_norm.weight", (hidden,), norm), (f"blk.{i}.ffn_norm.weight", (hidden,), norm),
           (f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), main),
           (f"blk.{i}.attn_k.weight", (kv * head_dim, hidden), main),
           (f"blk.{i}.attn_v.weight", (kv * head_dim, hidden), main if later else high),
           (f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), main),
           (f"blk.{i}.ffn_gate.weight", (inter, hidden), main), (f"blk.{i}.ffn_up.weight", (inter, hidden), main),
           (f"blk.{i}.ffn_down.weight", (hidden, inter), main if later else high)]
    if gemma:  # the attention's and the MLP's outputs normed before each residual add
        out += [(f"blk.{i}.post_attention_norm.weight", (hidden,), "norm"),
                (f"blk.{i}.post_ffw_norm.weight", (hidden,), "norm")]
    if arch in ("qwen3", "gemma3"):
        out += [(f"blk.{i}.attn_q_norm.weight", (head_dim,), "norm"), (f"blk.{i}.attn_k_norm.weight", (head_dim,), "norm")]
    return out


def make_shaped(shape: str, mix: str, dst: Path, seed: int = 0, norms: str = "F32") -> Path:
    """Write the file; `norms`: the type the drawn norms are stored in (F32, as llama.cpp writes them, or F16)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    from .runner import _bundled_gguf

    hidden, inter, layers, heads, kv, head_dim, arch = SHAPES[shape]
    main, high = MIXES[mix]
    reader = gguf.GGUFReader(str(_bundled_gguf()))
    writer = gguf.GGUFWriter(str(dst), arch)
    own = {f"{arch}.{k}": v for k, v in (("embedding_length", hidden), ("feed_forward_length", inter),
                                         ("block_count", layers), ("attention.head_count", heads),
                                         ("attention.head_count_kv", kv), ("rope.dimension_count", head_dim))}
    if arch != "llama":
        own.update({f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim})
    extra = {f"{arch}.{k}": v for k, v in GEMMA_KEYS.get(shape, {}).items()}
    for field in reader.fields.values():
        # the bundled file's other hyperparameters (context length, rope base, norm epsilon) under `arch`
        name = arch + field.name[len("llama"):] if field.name.startswith("llama.") else field.name
        if name in own or name in extra or name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or \
                name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for key, value in own.items():
        writer.add_uint32(key, value)
    for key, value in extra.items():
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensors = [("token_embd.weight", (vocab, hidden), high),
               ("output_norm.weight", (hidden,), "norm" if arch.startswith("gemma") else "F32")]
    for i in range(layers):
        tensors += _layer_tensors(i, arch, SHAPES[shape], main, high)
    rng = np.random.default_rng(seed)
    datas = []
    for name, shp, qtype in tensors:
        if qtype in FALLBACK and shp[-1] % 256:
            qtype = FALLBACK[qtype]
        if qtype == "F32":
            data = np.ones(shp, np.float32)
        elif qtype == "norm":
            data, qtype = (1 + 0.2 * rng.standard_normal(shp)).astype({"F32": np.float32, "F16": np.float16}[norms]), norms
        else:
            data = _encode(rng.standard_normal(shp, dtype=np.float32) * np.float32(0.02), qtype)
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, T[qtype])
        datas.append(data)
    writer.add_file_type(gguf.LlamaFileType[{"Q4_K_M": "MOSTLY_Q4_K_M", "Q5_K_M": "MOSTLY_Q5_K_M"}.get(mix, f"MOSTLY_{mix}")])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in datas:
        writer.write_tensor_data(data)
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("mix", choices=sorted(MIXES))
    ap.add_argument("dst")
    args = ap.parse_args(argv)
    print(make_shaped(args.shape, args.mix, Path(args.dst)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
