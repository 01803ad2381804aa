"""Through the service, one caller: `python -m trserve.bench.service [--model FILE] [--threads T] [--peer]`.

Starts `trserve serve` as a separate process (port 0; `--model`, `--threads` passed on), then sends the
same chat prompts, one at a time, through its Generate RPC (tenant "bench-tr", its own hot matrix; with
`--ar` also plain decoding, tenant "bench-ar") and
through the other sides, alternating per prompt so drift hits all: an in-process Decoder of the same
model (what gRPC costs), and with `--peer` llama.cpp's own server on the same file and threads
(`make llama-server`; the prompt as the same chat-templated ids, greedy). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from .cli import DEFAULT_PROMPTS


def _start_server(model: str | None, threads: int | None) -> tuple[subprocess.Popen, str]:
    extra = [*(["--model", model] if model else []), *(["--threads", str(threads)] if threads else [])]
    proc = subprocess.Popen([sys.executable, "-m", "trserve.services.cli", "--log-level", "WARNING", "serve", "--port", "0",
                             "--http-port", "0", "--metrics-port", "-1", *extra], stdout=subprocess.PIPE, text=True)
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


def _grpc(client, args, steps: list[int], mode: str = "tr"):
    def run(messages) -> int:
        stats = client.generate(messages=messages, tenant=f"bench-{mode}", max_new_tokens=args.max_new_tokens,
                                mode=mode).stats
        steps.append(stats.steps)  # decoding forwards after the prefill: tokens / steps is the MAT
        return stats.generated_tokens
    return run


def _sides(args, client, stack, steps: list[int]) -> dict:
    """name -> callable(messages) -> generated token count, for each side measured (`steps`: the gRPC
    side's steps per request, appended)."""
    from ..engine import Decoder, DecoderConfig, ModelConfig

    source = {"source": args.model} if args.model else {}
    decoder = Decoder(DecoderConfig(model=ModelConfig(**source, threads=args.threads)))
    matrix = decoder.new_matrix()
    sides = {"grpc": _grpc(client, args, steps), **({"grpc-ar": _grpc(client, args, [], "ar")} if args.ar else {}),
             "in-process": lambda m: len(decoder.generate(messages=m, max_new_tokens=args.max_new_tokens,
                                                          matrix=matrix).ids)}
    if args.peer:
        from .llama_server import ServerDecoder

        if not (args.model or "").endswith(".gguf"):
            raise SystemExit("--peer needs --model FILE.gguf (llama-server runs the same file)")
        peer = stack.enter_context(closing(ServerDecoder("llama-server", args.model, decoder.tokenizer,
                                                          args.threads or 2)))
        sides["llama-server"] = lambda m: len(peer(m, args.max_new_tokens)[0])
    return sides


def main(argv: list[str] | None = None) -> int:
    from contextlib import ExitStack

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--model", default=None, help="model source for every side (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--peer", action="store_true", help="also llama.cpp's own server on the same --model file")
    ap.add_argument("--ar", action="store_true", help="also plain decoding through Generate (its own tenant)")
    ap.add_argument("--json", default="bench-results/grpc_vs_inprocess.json")
    args = ap.parse_args(argv)

    from trserve_client import Client
    from .host import host_facts, host_line

    proc, addr = _start_server(args.model, args.threads)
    try:
        with ExitStack() as stack, Client(addr, timeout=600) as client:
            steps: list[int] = []
            sides = _sides(args, client, stack, steps)
            totals = {name: [0, 0.0] for name in sides}
            for prompt in _questions(args.prompts, args.n):
                for name, run in sides.items():
                    t = time.perf_counter()
                    totals[name][0] += run([{"role": "user", "content": prompt}])
                    totals[name][1] += time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(30)
    report = {k: {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s, 3)} for k, (n, s) in totals.items()}
    report["grpc"]["steps"] = sum(steps)
    report["grpc"]["mean_accepted_tokens"] = round(report["grpc"]["tokens"] / max(1, sum(steps)), 3)
    report["grpc_vs_in_process"] = round(report["grpc"]["tokens_per_s"] / report["in-process"]["tokens_per_s"], 4)
    if "llama-server" in report:
        report["grpc_vs_llama_server"] = round(report["grpc"]["tokens_per_s"] / report["llama-server"]["tokens_per_s"], 4)
    if "grpc-ar" in report:
        report["grpc_tr_vs_ar"] = round(report["grpc"]["tokens_per_s"] / report["grpc-ar"]["tokens_per_s"], 4)
    report["config"], report["environment"] = vars(args), host_facts()
    print(host_line({**report["environment"], "threads": args.threads or "default"}))
    for k in totals:
        mat = f", MAT {report[k]['mean_accepted_tokens']:.2f}" if "steps" in report[k] else ""
        print(f"{k:<13} {report[k]['tokens_per_s']:7.2f} tok/s  ({report[k]['tokens']} tokens{mat})")
    print(f"gRPC / in-process = {report['grpc_vs_in_process']:.3f}" + (
        f"; gRPC / llama-server = {report['grpc_vs_llama_server']:.3f}" if "grpc_vs_llama_server" in report else "")
          + (f"; gRPC tr / ar = {report['grpc_tr_vs_ar']:.3f}" if "grpc_tr_vs_ar" in report else ""))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
