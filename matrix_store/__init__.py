"""Adjacency-matrix state: versioned [V, K] matrices per (model fingerprint, tenant), with
inheritance (tenant <- domain <- _global <- zeros), Redis snapshots, rollback and memory bounds.

No grpc, protobuf or torch here; services/ converts at the edge.
"""

from core.model_spec import ModelSpec
from core.tenants import GLOBAL_TENANT
from matrix_store.config import StoreConfig
from matrix_store.store import MatrixStore
from matrix_store.tenant import Checkout

__all__ = ["GLOBAL_TENANT", "Checkout", "MatrixStore", "ModelSpec", "StoreConfig"]
