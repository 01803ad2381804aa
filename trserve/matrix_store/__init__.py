"""Adjacency-matrix state: versioned [V, K] matrices per (model fingerprint, tenant), with
inheritance (tenant <- domain <- _global <- zeros), Redis snapshots, rollback and memory bounds.

No grpc, protobuf or torch here; trserve/services/ converts at the edge.
"""

from trserve.core.model_spec import ModelSpec
from trserve.core.tenants import GLOBAL_TENANT
from trserve.matrix_store.config import StoreConfig
from trserve.matrix_store.store import MatrixStore
from trserve.matrix_store.tenant import Checkout

__all__ = ["GLOBAL_TENANT", "Checkout", "MatrixStore", "ModelSpec", "StoreConfig"]
