"""ModelSpec: validated from request data; `require` tells another model from another shape."""

import pytest

from trserve.core.errors import FingerprintMismatch, InvalidArgument
from trserve.core.model_spec import ModelSpec


def test_spec_validates_its_fields() -> None:
    assert ModelSpec("fp", 10, 2).shape == (10, 2)
    for bad in (("", 10, 2), ("fp", 0, 2), ("fp", 10, 0), ("fp", 10, 65), ("fp", True, 2), ("fp", 10, 2.0)):
        with pytest.raises(InvalidArgument):
            ModelSpec(*bad)


def test_require_names_the_mismatch() -> None:
    spec = ModelSpec("fp", 10, 2)
    spec.require(ModelSpec("fp", 10, 2))
    with pytest.raises(FingerprintMismatch, match="fingerprint 'fp' but the model is 'other'"):
        spec.require(ModelSpec("other", 10, 2))
    with pytest.raises(InvalidArgument, match=r"\[V=10, K=2\] but the decoder uses \[V=10, K=4\]") as exc:
        spec.require(ModelSpec("fp", 10, 4))
    assert not isinstance(exc.value, FingerprintMismatch)
