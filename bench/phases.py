"""The native forward's cost by phase, per width (`trserve bench --profile`).

A profiling build of the kernels (csrc/forward.c with -DTR_PHASES: the served library never has it)
times each phase of the forward as its thread 0 sees it: q/k/v (norm, quantization and the three
linears), rotary and the KV write, attention, o, gate/up with SiLU, down, the LM head, the top-k
with confidences, and what is left of the call (buffers, the embedding copy, waking the threads).
Each phase but the LM head's ends at a barrier, so it includes waiting for the slower thread. The
forwards run through a runner of their own, as `engine/tuning/calibrate.py:measure` times them: w
new tokens over `kv` cached ones, one sequence. Where a verified row's cost goes is the difference
between widths.
"""

from __future__ import annotations

import torch

from ..engine.model.kernels.build import PHASES, phases_library


def forward_phases(loaded, widths: tuple[int, ...], kv: int, calls: int = 20) -> dict[str, dict[str, float]]:
    """{str(width): {phase: ms per forward, ..., "other": the call's rest, "call": the whole call}} for
    `loaded` (a native forward on the compressed kernels): the mean of `calls` forwards after 3
    untimed ones."""
    from ..engine.model.runner import ModelRunner, RowInput, quiet_torch_threads, uses_kernel_pool

    if loaded.forward != "native" or not loaded.isa:
        raise ValueError("phases are timed in the native forward on the compressed kernels")
    forward, read = phases_library(loaded.isa)
    out_buf = torch.zeros(len(PHASES) + 1, dtype=torch.float64)  # the phases, then the whole call
    vocab = int(loaded.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    report = {}
    with torch.inference_mode(), quiet_torch_threads(uses_kernel_pool(loaded.model)):
        runner = ModelRunner(loaded.model, 1, torch.float32, native=loaded.native)
        runner.native._fn = forward  # this runner only: the same arguments, phases timed
        row = runner.kv.open_row()
        runner.prefill(row, torch.randint(0, vocab, (kv,), generator=g), torch.tensor([kv - 1]))
        runner.kv.activate(row)
        for w in widths:
            one = RowInput(torch.randint(0, vocab, (w,), generator=g), torch.arange(w), torch.zeros(w, w))
            for _ in range(3):
                runner.single_step(row, one)
            read(out_buf.data_ptr(), out_buf.numel())  # drop the untimed ones
            for _ in range(calls):
                runner.single_step(row, one)
            n = read(out_buf.data_ptr(), out_buf.numel())
            ms = (1000.0 * out_buf / max(n, 1)).tolist()
            phases = dict(zip(PHASES, ms))
            phases["other"] = ms[-1] - sum(ms[:-1])
            phases["call"] = ms[-1]
            report[str(w)] = {k: round(v, 3) for k, v in phases.items()}
    return report


def format_phases(phases: dict[str, dict[str, float]]) -> list[str]:
    """The phases as table lines: one row per phase, one column per width, then each width's cost
    past width 1 per extra row."""
    widths = list(phases)
    names = [*PHASES, "other", "call"]
    lines = [f"{'phase':<12}" + "".join(f"{'w=' + w:>9}" for w in widths) + "   (ms per forward, native)"]
    for name in names:
        lines.append(f"{name:<12}" + "".join(f"{phases[w][name]:>9.3f}" for w in widths))
    if len(widths) > 1 and widths[0] == "1":
        lines.append(f"{'per row':<12}" + "".join(
            f"{(phases[w]['call'] - phases['1']['call']) / (int(w) - 1):>9.3f}" if w != "1" else f"{'':>9}"
            for w in widths) + "   (ms per row past the first)")
    return lines
