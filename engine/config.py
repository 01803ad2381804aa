"""Validated engine configuration, built once in main() and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from .model.loader import ModelConfig
from .tuning.online import AutoTuneConfig

# The best known tree per device kind and linear kernels (see README "Benchmarks"; `trserve tune`
# makes one for another machine, `trserve bench --tree` compares). A forward's cost per width
# decides the tree: the compressed kernels make one token much cheaper than the packed ones do.
DEFAULT_TREES = {"cpu": "cpu-hybrid-packed", "cuda": "paper"}
KERNEL_TREES = {("cpu", "compressed"): "dynamic"}  # where the kernels change the best tree


@dataclass(frozen=True)
class DecoderConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # builtin tree name, template file path, auto = best known for the device, or adaptive = start
    # from auto and keep re-tuning online (engine/tuning/online.py, settings in `autotune`)
    tree: str = "auto"
    k: int = 8  # successors kept per token in the adjacency matrix
    max_context: int | None = None  # default: the model's max_position_embeddings
    # Seed the matrix with the model's own next-token top-K at the last N prompt positions
    # (one wider lm_head in the prefill); 0 = off. Catches what the request itself repeats, and gives
    # a tenant's first request a warm matrix (the batch budget learns node rates from it). Each
    # seeded position costs an LM-head row (~25% of a prefilled token): 512 cost TR 10-17% of its
    # throughput on the dev prompts (2-core AVX-512 host) and made prefill chunks up to 4x slower.
    # Only positions whose token's row the tenant's matrix lacks are seeded (a token's last
    # occurrence): on a warm tenant a prompt seeds next to nothing (tr/recycle.py:seed_positions).
    seed_from_prompt: int = 64
    autotune: AutoTuneConfig = field(default_factory=AutoTuneConfig)
    cache_dir: str | None = None  # calibration cache for adaptive trees; default ~/.cache/trserve

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 64:
            raise ValueError(f"k must be in [1, 64], got {self.k}")
        if self.seed_from_prompt < 0:
            raise ValueError(f"seed_from_prompt must be >= 0, got {self.seed_from_prompt}")
        if self.max_context is not None and self.max_context < 16:
            raise ValueError(f"max_context must be >= 16, got {self.max_context}")

    def tree_for(self, device_type: str, kernels: str = "stock") -> str:
        """The configured tree, or for auto/adaptive the best known one for this device and kernels."""
        if self.tree not in ("auto", "adaptive"):
            return self.tree
        main = kernels.split("+")[0]  # compressed+packed: most layers are compressed
        return KERNEL_TREES.get((device_type, main)) or DEFAULT_TREES.get(device_type, "paper")
