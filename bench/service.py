"""gRPC end to end vs in-process: `python -m trserve.bench.service [--prompts P] [--n N] [--max-new-tokens M]`.

Starts `trserve serve` as a separate process (port 0), then runs the same prompts through its
Generate RPC and through an in-process Decoder, alternating per prompt so drift hits both; each
side has its own fresh hot matrix (one tenant). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from .cli import DEFAULT_PROMPTS


def _start_server() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "trserve.services.cli", "--log-level", "WARNING", "serve", "--port", "0", "--http-port", "0",
                             "--metrics-port", "-1"], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        m = re.search(r"listening on (\S+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("trserve serve exited before listening")


def _questions(path: str, n: int) -> list[str]:
    by_cat = collections.defaultdict(list)
    for line in Path(path).read_text().splitlines():
        q = json.loads(line)
        by_cat[q["category"]].append(q["turns"][0])
    firsts = [qs[0] for qs in by_cat.values()]
    return (firsts * (n // len(firsts) + 1))[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json", default="bench-results/grpc_vs_inprocess.json")
    args = ap.parse_args(argv)

    from ..engine import Decoder, DecoderConfig
    from ..services.client.client import TRServeClient

    proc, addr = _start_server()
    try:
        decoder = Decoder(DecoderConfig())
        matrix = decoder.new_matrix()
        totals = {"grpc": [0, 0.0], "in-process": [0, 0.0]}
        with TRServeClient(addr, timeout=600) as client:
            for prompt in _questions(args.prompts, args.n):
                messages = [{"role": "user", "content": prompt}]
                t = time.perf_counter()
                r = client.generate(messages=messages, tenant="bench", max_new_tokens=args.max_new_tokens)
                totals["grpc"][0] += r.stats.generated_tokens
                totals["grpc"][1] += time.perf_counter() - t
                t = time.perf_counter()
                local = decoder.generate(messages=messages, max_new_tokens=args.max_new_tokens, matrix=matrix)
                totals["in-process"][0] += len(local.ids)
                totals["in-process"][1] += time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(30)
    report = {k: {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s, 3)} for k, (n, s) in totals.items()}
    report["grpc_vs_in_process"] = round(report["grpc"]["tokens_per_s"] / report["in-process"]["tokens_per_s"], 4)
    for k in ("grpc", "in-process"):
        print(f"{k:<11} {report[k]['tokens_per_s']:7.2f} tok/s  ({report[k]['tokens']} tokens)")
    print(f"gRPC / in-process = {report['grpc_vs_in_process']:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
