"""Cheap wide forwards on CPU: oneDNN linear layers with weights pre-packed once.

Stock `F.linear` with 2..32 rows re-packs the weight on every call; that is most of the cost of a
tree-verification forward on CPU. `pack_linears` swaps each `nn.Linear` of a loaded model for a
module that calls oneDNN with weights packed once at load time. The modeling code is untouched
(module swap only), and the plain autoregressive path of the engine uses the same kernels, so
tree and plain decoding compute the same function. Logits differ from stock by ~1e-4.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("trserve.engine")


class PackedLinear(nn.Module):
    """`nn.Linear` replacement: y = x @ W^T + b with a oneDNN pre-packed W (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight), persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def packed_kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (in place); returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, PackedLinear(child))
                replaced += 1
    if replaced:
        log.info("packed %d linear layers for oneDNN", replaced)
    return replaced
