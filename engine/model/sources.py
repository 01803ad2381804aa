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


def check_local_source(source: str) -> bool:
    """True where `source` (not a .gguf file) is a local checkpoint directory holding what it needs;
    NotFound, in one line, where it is a path that is not one; False where it reads as a hub id."""
    path = Path(source)
    if path.is_dir():
        check_model_dir(path)
        return True
    if path.exists():
        raise NotFound(f"--model {source!r} is a file but not a .gguf one: pass a GGUF file or a transformers "
                       "checkpoint directory (config.json, tokenizer, weights)")
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise NotFound(f"--model {source!r} does not exist (not a file or directory here)")
    return False
