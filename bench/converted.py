"""Random-weight checkpoints of real models' shapes, and the same weights through llama.cpp's converter
(issue 57: "a Qwen3-0.6B-shaped and a Gemma-3-1B-shaped random model: forward per width beside llama-bench
on the same weights converted to GGUF"). bench/files.py measures the checkpoint as trserve loads it
(quantized at load, `--quantize auto`) and the converter's Q8_0 file as it is, each beside llama-bench
on that Q8_0 file: the same weights, in the block type both engines then run.

The shapes are bench/shaped.py's SHAPES (the bundled 49,152-token vocabulary and tokenizer; the
converter pads nothing, the configs take that vocabulary). transformers' own initialisation: random
weights, so the rows measure speed and memory, not text.

    python -m trserve.bench.converted SHAPE DIR     (prints the checkpoint's and the file's paths)
"""

from __future__ import annotations

import sys
from pathlib import Path

CONVERTED = ("qwen3-0.6b", "gemma3-1b")


def checkpoint_config(shape: str):
    """transformers' config of bench/shaped.py shape `shape` (a llama, qwen3 or gemma3 one)."""
    import transformers as t

    from .shaped import GEMMA_KEYS, SHAPES

    hidden, inter, layers, heads, kv, head_dim, arch = SHAPES[shape]
    common = dict(vocab_size=49152, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True,
                  max_position_embeddings=4096)
    if arch == "qwen3":
        return t.Qwen3Config(**common)
    if arch == "llama":
        return t.LlamaConfig(**common)
    if arch == "gemma3":  # five local layers, then a global one, as Gemma 3's
        window = GEMMA_KEYS.get(shape, {}).get("attention.sliding_window", 512)
        return t.Gemma3TextConfig(**common, sliding_window=window, query_pre_attn_scalar=head_dim,
                                  layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                               for i in range(layers)])
    raise ValueError(f"no checkpoint config for shape {shape} (architecture {arch})")


def make_converted(shape: str, folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """(checkpoint dir, the converter's Q8_0 file), made where missing: a bfloat16 checkpoint of `shape`
    with the bundled tokenizer, then `convert_hf_to_gguf.py --outtype q8_0` (bench/converter.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..engine.model.loader import builtin_model_dir
    from .converter import convert

    ckpt, gguf = folder / f"{shape}-random-bf16", folder / f"{shape}-random-converted-Q8_0.gguf"
    if not (ckpt / "config.json").exists():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(checkpoint_config(shape), dtype=torch.bfloat16)
        model.save_pretrained(ckpt)
        AutoTokenizer.from_pretrained(builtin_model_dir()).save_pretrained(ckpt)
        del model
    if not gguf.exists():
        convert(ckpt, gguf, "q8_0")
    return ckpt, gguf


if __name__ == "__main__":
    for p in make_converted(sys.argv[1], Path(sys.argv[2])):
        print(p)
