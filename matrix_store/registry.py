"""The models a store serves: the configured list, else the first `max_models` seen, each bounded
in bytes per tenant (see store.py: Bounds)."""

from __future__ import annotations

import logging
import threading

from ..core.errors import FingerprintMismatch, ModelNotServed
from ..core.model_spec import ModelSpec
from .config import StoreConfig, matrix_bytes

log = logging.getLogger("trserve.matrix_store")


class ModelRegistry:
    """Thread-safe set of served models, by fingerprint. Reads of a served model take no lock."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._models: dict[str, ModelSpec] = {m.fingerprint: m for m in config.models}
        self._lock = threading.Lock()

    def register(self, spec: ModelSpec) -> None:
        """Serve this model (a worker registering its model, or any first use). FailedPrecondition
        if the configured models do not include it, it is too large, or `max_models` are served."""
        served = self._models.get(spec.fingerprint)
        if served == spec:
            return
        with self._lock:
            served = self._models.get(spec.fingerprint)
            if served == spec:
                return
            if served is not None:
                raise FingerprintMismatch(
                    f"model {spec.fingerprint!r} is served here as [V={served.vocab_size}, K={served.k}], "
                    f"not [V={spec.vocab_size}, K={spec.k}]")
            self._admit(spec)
            self._models[spec.fingerprint] = spec
            log.info("serving model %s [V=%d, K=%d]", spec.fingerprint, spec.vocab_size, spec.k)

    def _admit(self, spec: ModelSpec) -> None:
        """ModelNotServed (a FailedPrecondition) unless a model not served yet may be added (called under the lock)."""
        if self._config.models:
            raise ModelNotServed(
                f"model {spec.fingerprint!r} is not served by this matrix service; it serves "
                f"{sorted(self._models)} (--model)")
        nbytes = matrix_bytes(spec)  # ids and confidences
        if nbytes > self._config.max_matrix_bytes:
            raise ModelNotServed(
                f"a matrix of [V={spec.vocab_size}, K={spec.k}] takes {nbytes} bytes per tenant; this service "
                f"serves matrices of at most {self._config.max_matrix_bytes} bytes (max_matrix_bytes)")
        if len(self._models) >= self._config.max_models:
            raise ModelNotServed(
                f"model {spec.fingerprint!r} is not served: this service already serves "
                f"{len(self._models)} models {sorted(self._models)} (max_models = {self._config.max_models})")

    def models(self) -> list[ModelSpec]:
        return sorted(self._models.values(), key=lambda m: m.fingerprint)
