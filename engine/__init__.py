"""Token Recycling decoding engine (no grpc, no redis)."""

from engine.config import DecoderConfig
from engine.decoder import Decoder
from engine.errors import InvalidArgument
from engine.matrix import AdjacencyMatrix, DraftSource, LocalDraftSource
from engine.model_loader import ModelConfig, load_model
from engine.stats import GenerationResult, GenerationStats, StepChunk

__all__ = [
    "AdjacencyMatrix", "Decoder", "DecoderConfig", "DraftSource", "GenerationResult", "GenerationStats",
    "InvalidArgument", "LocalDraftSource", "ModelConfig", "StepChunk", "load_model",
]
