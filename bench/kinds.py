"""A/B of the fewer-bit kernel kinds against the 8-bit kinds they replace, per width, interleaved:

    python -m trserve.bench.kinds [--threads 2] [--widths 1,2,4,8,16] [--arithmetics exact,int8]

Q6_K as its 6-bit codes (kind 20) against the same blocks as 8-bit codes (kind 18), and Q5_K as 5-bit
codes (kind 22) against kind 10 (docs/kernels.md): the same weights and output bits, fewer bytes read,
more unpacking. Blocks are encoded from random normal rows (engine/model/kernels/kencode.py) in shapes
where the files hold these types: the bundled model's ffn_down (1536 -> 576) and a 1.7B Llama's
ffn_down and ffn_up (8192 -> 2048, 2048 -> 8192). Each figure is the fastest of many single calls
(microseconds), the two kinds alternating per round so a busy spell hits both; the ratio is few / 8-bit.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from .qlinear_isa import fastest_call_us

SHAPES = (("bundled down", 1536, 576), ("1.7B down", 8192, 2048), ("1.7B up", 2048, 8192))
PAIRS = (("Q6_K", 20, 18), ("Q5_K", 22, 10))


def layers(kind_name: str, in_f: int, out_f: int, isa: str, arithmetic: str) -> tuple:
    """(fewer-bit QLinear, 8-bit QLinear) over the same blocks of `kind_name` [out_f, in_f]."""
    from ..engine.model.kernels.kencode import ENCODERS
    from ..engine.model.kernels.kquants import as_8bit, decode
    from ..engine.model.kernels.qlinear import QLinear
    from ..engine.model.paths import default_cache_dir

    rows = np.random.default_rng(in_f + out_f).standard_normal((out_f, in_f)).astype(np.float32) * 0.02
    raw = np.asarray(ENCODERS[kind_name](rows)).view(np.uint8).reshape(out_f, -1)  # [O, bytes per row]
    blocks = decode(kind_name, raw, out_f, in_f)

    def build(b):
        arrays = (None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in b[1:])
        return QLinear(b[0], *arrays, None, in_f, out_f, default_cache_dir(), isa, arithmetic)

    return build(blocks), build(as_8bit(blocks))


def ab(few, eight, in_f: int, width: int, rounds: int = 5) -> tuple[float, float]:
    """Fastest microseconds per call of each, `rounds` alternations of a short timing each."""
    x = torch.randn(width, in_f, generator=torch.Generator().manual_seed(width))
    best = [float("inf"), float("inf")]
    with torch.inference_mode():
        for _ in range(rounds):
            for i, layer in enumerate((few, eight)):
                best[i] = min(best[i], fastest_call_us(lambda: layer(x), calls=40, budget_s=0.15))
    return best[0], best[1]


def main(argv: list[str] | None = None) -> None:
    from ..engine.model.kernels.build import available_isas
    from .host import host_facts, host_line

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--widths", default="1,2,4,8,16")
    p.add_argument("--arithmetics", default="exact,int8")
    p.add_argument("--json", default="bench-results/kinds.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    isa, widths = available_isas()[0], [int(w) for w in args.widths.split(",")]
    print(host_line({**host_facts(), "threads": args.threads}), f"kernels {isa}")
    out = []
    for arithmetic in args.arithmetics.split(","):
        for kind_name, few_kind, eight_kind in PAIRS:
            for label, in_f, out_f in SHAPES:
                few, eight = layers(kind_name, in_f, out_f, isa, arithmetic)
                assert (few.kind, eight.kind) == (few_kind, eight_kind)
                times = [ab(few, eight, in_f, w) for w in widths]
                out.append({"arithmetic": arithmetic, "type": kind_name, "kinds": [few_kind, eight_kind],
                            "shape": label, "in": in_f, "out": out_f,
                            "us": {w: [round(a, 1), round(b, 1)] for w, (a, b) in zip(widths, times)}})
                cells = "  ".join(f"w{w} {a:7.1f}/{b:7.1f} ({a / b:.2f})" for w, (a, b) in zip(widths, times))
                print(f"{arithmetic:5} {kind_name} {few_kind}/{eight_kind} {label:13} {cells}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"environment": host_facts(), "threads": args.threads, "isa": isa, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
