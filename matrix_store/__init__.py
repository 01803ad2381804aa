"""Adjacency-matrix state: versioned [V, K] matrices per (model fingerprint, tenant), with
inheritance (tenant <- domain <- _global <- zeros), Redis snapshots, rollback and memory bounds.

No grpc, protobuf or torch here; services/ converts at the edge.
"""

if __name__ != "trserve.matrix_store":  # matrix_store/ sits at the repository root; trserve.matrix_store is its only import name
    raise ImportError(f"import trserve.matrix_store, not {__name__}: matrix_store/ installs under the trserve name only")

from ..core.model_spec import ModelSpec
from ..core.tenants import GLOBAL_TENANT
from .config import StoreConfig
from .store import MatrixStore
from .tenant import Checkout

__all__ = ["GLOBAL_TENANT", "Checkout", "MatrixStore", "ModelSpec", "StoreConfig"]
