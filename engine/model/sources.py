"""What a `--model` directory must hold to be loaded (checked before transformers reads it, so an
unusable path is one line naming it and what it lacks, not a traceback about a tokenizer library)."""

from __future__ import annotations

from pathlib import Path

from ...core.errors import NotFound
from .choices import BUILTIN_MODEL

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


def check_hub_model(source: str) -> None:
    """A hub id must be in the local model cache, or the hub must answer for it, within seconds: else
    NotFound at once (transformers would retry for about a minute on a machine without a hub)."""
    from huggingface_hub import model_info, try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(source, "config.json"), str):
            return  # cached: transformers loads it without asking the hub
    except ValueError:  # not a valid repository id either
        raise NotFound(f"model {source!r} is not a builtin name ({BUILTIN_MODEL}), a local directory or a "
                       "hub id") from None
    try:
        model_info(source, timeout=10)
    except Exception as e:  # unreachable, offline mode, unknown or gated repository
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise NotFound(f"model {source!r} is not a builtin name ({BUILTIN_MODEL}), a local directory or in the "
                       f"local model cache, and the hub could not provide it ({type(e).__name__}: {reason}); "
                       "pass a local transformers directory") from None


def check_chat_template(template: str) -> None:
    """ValueError where a chat template is empty or not valid Jinja (said at configuration, not at
    the first chat request)."""
    import jinja2

    if not template.strip():
        raise ValueError("the chat template is empty")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
