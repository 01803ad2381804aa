"""The native forward's phase timing (`trserve bench --profile`): a profiling build of the kernels
that must compute what the served one does, and phases that account for the call."""

import pytest
import torch

from trserve.bench.phases import forward_phases, format_phases
from trserve.engine.model.kernels.build import PHASES, phases_library


@pytest.fixture(scope="module")
def native(loaded_smollm2):
    if loaded_smollm2.forward != "native" or not loaded_smollm2.isa:
        pytest.skip("the native forward on the compressed kernels does not run here")
    return loaded_smollm2


def test_profiling_build_gives_the_served_builds_logits(native):
    """-DTR_PHASES adds clock reads between phases and nothing else: the same logits, bit for bit, for
    a 5-token tree step over a 40-token context."""
    from trserve.engine.model.runner import ModelRunner, RowInput, quiet_torch_threads, uses_kernel_pool

    g = torch.Generator().manual_seed(3)
    with torch.inference_mode(), quiet_torch_threads(uses_kernel_pool(native.model)):
        runner = ModelRunner(native.model, 1, torch.float32, native=native.native)
        row = runner.kv.open_row()
        runner.prefill(row, torch.randint(0, 49152, (40,), generator=g), torch.tensor([39]))
        runner.kv.activate(row)
        mask = torch.full((5, 5), torch.finfo(torch.float32).min).triu(1)
        mask[3, 1] = mask[3, 2] = torch.finfo(torch.float32).min  # node 3 hangs off node 0
        step = RowInput(torch.randint(0, 49152, (5,), generator=g), torch.tensor([0, 1, 2, 1, 2]), mask)
        served = runner.single_step(row, step)
        runner.native._fn = phases_library(native.isa)[0]
        profiled = runner.single_step(row, step)
    assert torch.equal(served, profiled)


def test_phases_account_for_the_call_and_grow_with_rows(native):
    phases = forward_phases(native, (1, 64), kv=64, calls=3)
    for w in ("1", "64"):
        ms = phases[w]
        assert set(ms) == {*PHASES, "other", "call"}
        assert all(ms[p] >= 0 for p in PHASES) and ms["call"] > 0
        assert sum(ms[p] for p in PHASES) <= ms["call"] + 1e-3  # the phases lie inside the call
        assert ms["topk"] == 0  # single steps ask for no top-k
    # 64 rows' products cost more than one's: well past the weights' read, which one row's mostly is (at
    # 8 rows the two are close enough for a busy host's noise to order them either way)
    assert phases["64"]["gate_up"] > phases["1"]["gate_up"]
    lines = format_phases(phases)
    assert lines[0].startswith("phase") and lines[-1].startswith("per row")
