"""Token Recycling decoding engine (no grpc, no redis).

    decoder.py    the decode loop (Decoder: prepare -> stream)     results.py  what it returns
    sequence.py   one request in flight                             config.py   DecoderConfig
    runtime.py    what a decoder runs on (device, kernels, attention, tree, threads)
    tr/           the algorithm: trees, drafting, acceptance, recycling, sampling, lookup chains,
                  the adjacency matrix and the draft-source boundary
    model/        the target model: loading, kernels, attention, KV cache, the verification forward
    tuning/       acceptance records, calibration, the tree optimiser, online re-tuning, `trserve tune`
    request/      the request type, prompt building, stop conditions, streamed text

Public names are imported lazily so that `import engine` stays cheap (no torch until used).
"""

from importlib import import_module

_EXPORTS = {
    "AdjacencyMatrix": "engine.tr.matrix",
    "Decoder": "engine.decoder",
    "DecoderConfig": "engine.config",
    "DraftSource": "engine.tr.source",
    "GenerationRequest": "engine.request.request",
    "GenerationResult": "engine.results",
    "GenerationStats": "engine.results",
    "InvalidArgument": "core.errors",
    "LocalDraftSource": "engine.tr.source",
    "ModelConfig": "engine.model.loader",
    "ModelSpec": "core.model_spec",
    "RuntimeInfo": "engine.runtime",
    "SamplingParams": "engine.tr.sampling",
    "StepChunk": "engine.results",
    "load_model": "engine.model.loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
