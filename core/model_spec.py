"""The identity of the model an adjacency matrix belongs to: a matrix is only valid for one."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FingerprintMismatch, InvalidArgument


@dataclass(frozen=True)
class ModelSpec:
    """Which model (tokenizer/vocabulary) a matrix belongs to, and its shape [V, K].

    Built from request data too, so a bad value raises InvalidArgument (a ValueError).
    """

    fingerprint: str  # model/vocab fingerprint; matrices of different fingerprints never mix
    vocab_size: int  # V: rows of the matrix
    k: int  # K: successors kept per row

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, str) or not self.fingerprint:
            raise InvalidArgument(f"ModelSpec.fingerprint must be a non-empty string, got {self.fingerprint!r}")
        if not _is_int(self.vocab_size) or self.vocab_size <= 0:
            raise InvalidArgument(f"ModelSpec.vocab_size must be an int > 0, got {self.vocab_size!r}")
        if not _is_int(self.k) or not 1 <= self.k <= 64:
            raise InvalidArgument(f"ModelSpec.k must be an int in 1..64, got {self.k!r}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.vocab_size, self.k)

    def require(self, other: ModelSpec, what: str = "matrix") -> None:
        """Raise unless `other` is this very model and shape: FingerprintMismatch for another model,
        InvalidArgument for the same model with another shape."""
        if other.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"{what} was built for model fingerprint {self.fingerprint!r} but the model is {other.fingerprint!r}; "
                "use a fresh matrix for this model"
            )
        if other.shape != self.shape:
            raise InvalidArgument(f"{what} is [V={self.vocab_size}, K={self.k}] but the decoder uses "
                                  f"[V={other.vocab_size}, K={other.k}]")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
