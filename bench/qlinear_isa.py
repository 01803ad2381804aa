"""Time one compressed linear forward per ISA variant, layer shape and batch width.

    python -m trserve.bench.qlinear_isa [--threads 2] [--widths 1,2,4,8,16] [--isas avx512,avx2,scalar]
        [--arithmetics exact,int8] [--packed]

Shapes are the bundled SmolLM2's: q4 576->1536 (gate/up), 1536->576 (down), 576->576 (q/o) and the
q8 lm_head 576->49152. Each figure is the fastest of many single calls (microseconds): on a shared
host the fastest call is the one nobody interrupted, which is the kernel's own time.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

SHAPES = (("q4", 576, 1536), ("q4", 1536, 576), ("q4", 576, 576), ("q8", 576, 49152))


def block_weights(kind: str, out_f: int, in_f: int, seed: int = 1) -> torch.Tensor:
    """[out_f, in_f] float32 weights that are exact Q4_1 (kind q4) or Q8_0 (q8) blocks of 32."""
    g = torch.Generator().manual_seed(seed)
    nb = in_f // 32
    if kind == "q4":
        q = torch.randint(0, 16, (out_f, nb, 32), generator=g).float()
        q[..., 0], q[..., 1] = 0, 15  # as in GGUF: a block's min is q = 0 and its max q = 15 (else not recoverable)
        d = (torch.rand(out_f, nb, generator=g) * 0.02 + 1e-4).half().float()
        m = (-7.5 * d).half().float()
        return (q * d[..., None] + m[..., None]).reshape(out_f, in_f)
    q = torch.randint(-127, 128, (out_f, nb, 32), generator=g).float()
    q[..., 0] = 127  # as in GGUF: |q| = 127 somewhere in the block gives d exactly
    d = (torch.rand(out_f, nb, generator=g) * 0.01 + 1e-4).half().float()
    return (q * d[..., None]).reshape(out_f, in_f)


def fastest_call_us(f, calls: int = 150, budget_s: float = 0.5) -> float:
    for _ in range(2):
        f()
    best, end = float("inf"), time.perf_counter() + budget_s
    for i in range(calls):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
        if t0 > end and i >= 10:
            break
    return best * 1e6


def main(argv: list[str] | None = None) -> None:
    from ..engine.model.packed import PackedLinear
    from ..engine.model.paths import default_cache_dir
    from ..engine.model.kernels.build import available_isas
    from ..engine.model.kernels.qlinear import quantize_linears

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--widths", default="1,2,4,8,16")
    p.add_argument("--isas", default=",".join(available_isas()), help="variants to time (default: all this CPU runs)")
    p.add_argument("--arithmetics", default="exact,int8", help="the kernels' arithmetics to time (exact, int8)")
    p.add_argument("--packed", action="store_true", help="also time oneDNN packed linears")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    print(f"threads={args.threads}; fastest call, us, for n = {widths}")
    for kind, in_f, out_f in SHAPES:
        lin = nn.Linear(in_f, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(block_weights(kind, out_f, in_f))
        layers = {}
        for isa in args.isas.split(","):
            for arithmetic in args.arithmetics.split(","):
                holder = nn.Sequential(lin)
                swapped, _ = quantize_linears(holder, default_cache_dir(), isa, arithmetic)
                if not swapped:  # never time stock torch under a kernel's name
                    raise SystemExit(f"{kind} {in_f}->{out_f}: the weights did not recover as blocks")
                layers[f"{isa} {arithmetic}"] = holder[0]
        if args.packed:
            layers["packed"] = PackedLinear(lin)
        for name, layer in layers.items():
            row = []
            for n in widths:
                x = torch.randn(n, in_f)  # [n, I]
                with torch.inference_mode():
                    row.append(fastest_call_us(lambda: layer(x)))
            print(f"{kind} {in_f:>5}->{out_f:<6} {name:>16}: " + " ".join(f"{t:9.1f}" for t in row), flush=True)


if __name__ == "__main__":
    main()
