"""What a target model runs on, in words: for ModelInfo, the worker's startup log line and /metrics.

The kernels and attention decide the speed far more than the algorithm does (compressed kernels
need AVX-512; other CPUs run the slower oneDNN packed ones), so operators need to see them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .target import TargetModel


@dataclass(frozen=True)
class RuntimeInfo:
    device: str  # "cpu", "cuda:0", ...
    kernels: str  # linear kernels: compressed, packed, compressed+packed (some layers each) or stock
    isa: str  # the compressed kernels' variant (avx512vnni, avx512, avx2, ...), "none" without them
    arithmetic: str  # the compressed kernels' arithmetic: exact or int8 (exact without them)
    quantize: str  # the format a checkpoint's linears were quantized to at load (q8_0, q6_k, q4_k), or none
    attention: str  # grouped_sdpa (engine/model/attention.py) or transformers' implementation (sdpa, eager)
    forward: str  # what runs a forward: native (engine/model/native.py: the whole stack in C) or transformers
    tree: str  # the default draft tree's name
    threads: int  # torch intra-op CPU threads the decode threads use

    @classmethod
    def of(cls, decoder: TargetModel) -> RuntimeInfo:
        import torch

        from .model.attention import attention_in_use

        loaded = decoder.loaded
        # torch.get_num_threads() answers for the calling OS thread (OpenMP), which need not be a
        # decode thread (a gRPC handler's thread may have started while a decode loop held its count at
        # 1); the configured count, else the count at load, is what the decode threads use.
        threads = decoder.config.model.threads or getattr(loaded, "threads", None) or torch.get_num_threads()
        return cls(device=str(decoder.device), kernels=loaded.kernels, isa=getattr(loaded, "isa", None) or "none",
                   arithmetic=getattr(loaded, "arithmetic", "exact"), quantize=getattr(loaded, "quantize", "none"),
                   attention=attention_in_use(loaded.model), forward=getattr(loaded, "forward", "transformers"),
                   tree=decoder.default_tree.template.name, threads=threads)

    def labels(self) -> dict[str, str]:
        return {"device": self.device, "kernels": self.kernels, "isa": self.isa, "arithmetic": self.arithmetic,
                "quantize": self.quantize,
                "attention": self.attention,
                "forward": self.forward,
                "tree": self.tree,
                "threads": str(self.threads)}

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.labels().items())
