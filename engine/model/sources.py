"""What a `--model` directory must hold to be loaded (checked before transformers reads it, so an
unusable path is one line naming it and what it lacks, not a traceback about a tokenizer library)."""

from __future__ import annotations

from pathlib import Path

from trserve.core.errors import NotFound

WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model", "*.tiktoken")


def check_model_dir(path: Path) -> None:
    """NotFound naming `path` and what it lacks, where it is no transformers checkpoint: config.json,
    a tokenizer (tokenizer.json, tokenizer.model, vocab.json, ...) and weights (safetensors or .bin)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(any(path.glob(p)) for p in TOKENIZER):
        missing.append("a tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if not any(any(path.glob(p)) for p in WEIGHTS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if missing:
        raise NotFound(f"--model directory {str(path)!r} is not a transformers checkpoint: it lacks "
                       f"{', '.join(missing)}")
