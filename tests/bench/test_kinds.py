"""The kinds A/B (`python -m trserve.bench.kinds`): both layers of a pair hold the same blocks as the
kinds named, give the same output bits, and the timing returns each one's fastest call."""

import pytest
import torch

from trserve.bench.kinds import PAIRS, ab, layers
from trserve.engine.model.kernels.build import available_isas, qlinear_supported

pytestmark = pytest.mark.skipif(not qlinear_supported(), reason="the compressed kernels need x86-64 Linux")


@pytest.mark.parametrize("kind_name, few_kind, eight_kind", PAIRS)
def test_pair_is_the_same_weights_in_two_kinds(kind_name, few_kind, eight_kind):
    few, eight = layers(kind_name, 512, 24, available_isas()[0], "int8")
    assert (few.kind, eight.kind) == (few_kind, eight_kind)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.equal(few(x), eight(x)) and few(x).abs().sum() > 0
    a, b = ab(few, eight, 512, 2, rounds=1)
    assert 0 < a < 1e6 and 0 < b < 1e6
