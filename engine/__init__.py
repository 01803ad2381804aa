"""Token Recycling decoding engine (no grpc, no redis).

Public names are imported lazily so that light modules (e.g. `engine.errors`, used by
matrix_store) do not pull in torch and transformers.
"""

from importlib import import_module

_EXPORTS = {
    "AdjacencyMatrix": "engine.matrix",
    "Decoder": "engine.decoder",
    "DecoderConfig": "engine.config",
    "DraftSource": "engine.matrix",
    "GenerationResult": "engine.stats",
    "GenerationStats": "engine.stats",
    "InvalidArgument": "engine.errors",
    "LocalDraftSource": "engine.matrix",
    "ModelConfig": "engine.model_loader",
    "SamplingParams": "engine.sampling",
    "StepChunk": "engine.stats",
    "load_model": "engine.model_loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
