"""Token Recycling decoding engine (no grpc, no redis).

    engine.py     the decode loop (BatchEngine: submit / step / run / stream; one request is B=1)
    scheduler.py  queues and KV budget (EngineConfig)   sequence.py  one request in flight
    target.py     the model facade (TargetModel: prepare, trees, matrices, tuners)
    decoder.py    the Python API (Decoder: a TargetModel with its engine; generate / stream)
    results.py    what it returns                       config.py    DecoderConfig
    runtime.py    what a decoder runs on (device, kernels, attention, tree, threads)
    prefix_cache.py  shared prompt prefixes' KV
    drafting/     drafting: the drafter, the TR step, proposers, the tree budget, draft sources
    tr/           the algorithm: trees, gather, acceptance, recycling, sampling, the adjacency matrix
    model/        the target model: loading, kernels, attention, KV cache, the verification forward
    tuning/       acceptance records, calibration, the tree optimiser, online re-tuning (the
                  `trserve tune` command is bench/tune.py)
    request/      the request type, prompt building, stop conditions, streamed text

Public names are imported lazily so that `import trserve.engine` stays cheap (no torch until used).
"""

if __name__ != "trserve.engine":  # engine/ sits at the repository root; trserve.engine is its only import name
    raise ImportError(f"import trserve.engine, not {__name__}: engine/ installs under the trserve name only")

from importlib import import_module

_EXPORTS = {
    "AdjacencyMatrix": "trserve.engine.tr.matrix",
    "BatchEngine": "trserve.engine.engine",
    "EngineConfig": "trserve.engine.scheduler",
    "TargetModel": "trserve.engine.target",
    "Decoder": "trserve.engine.decoder",
    "DecoderConfig": "trserve.engine.config",
    "DraftSource": "trserve.engine.tr.source",
    "GenerationRequest": "trserve.engine.request.request",
    "GenerationResult": "trserve.engine.results",
    "GenerationStats": "trserve.engine.results",
    "InvalidArgument": "trserve.core.errors",
    "LocalDraftSource": "trserve.engine.tr.source",
    "ModelConfig": "trserve.engine.model.loader",
    "ModelSpec": "trserve.core.model_spec",
    "RuntimeInfo": "trserve.engine.runtime",
    "SamplingParams": "trserve.engine.tr.sampling",
    "StepChunk": "trserve.engine.results",
    "load_model": "trserve.engine.model.loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trserve.engine' has no attribute {name!r}")
