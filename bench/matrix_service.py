"""Matrix service benchmark: draft round trip on loopback, and end-to-end tokens/s in-process vs
remote vs replica drafting. The service runs as a separate process (as in the split deployment),
so client and server do not share a GIL.

    python -m trserve.bench.matrix_service [--steps 2000] [--prompts 3] [--max-new-tokens 64] [--out FILE]
    python -m trserve.bench.matrix_service --steps 0 --workload repetitive --per-category 2 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "Write a short poem about the sea.",
    "List three uses of a paperclip and explain each in one sentence.",
    "Explain what a hash table is to a beginner.",
    "Give me a recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
]


def start_service(redis_url: str | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "trserve.services.cli", "--log-level", "WARNING", "matrix", "--host", "127.0.0.1", "--port", "0"]
    if redis_url:
        cmd += ["--redis-url", redis_url, "--key-prefix", f"trbench:{int(time.time())}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r":(\d+)$", line.strip())
    if match is None:
        proc.kill()
        raise RuntimeError(f"matrix service did not start: {line!r}")
    return proc, f"127.0.0.1:{match.group(1)}"


def round_trips(addr: str, tree_name: str, steps: int, vocab_size: int = 49152, k: int = 8) -> dict:
    """Latency of RemoteDraftSession.step (send the rows of one verification + root, get a tree)."""
    import torch

    from ..core.model_spec import ModelSpec
    from ..engine.tr.recycle import RecycledRows
    from ..engine.tr.tree import get_compiled, load_template
    from ..services.worker.drafting.remote import RemoteDraftSource

    tree = get_compiled(load_template(tree_name), "cpu", torch.float32)
    source = RemoteDraftSource(addr, f"bench-rtt-{tree_name}")
    session = source.open(tree, ModelSpec("bench-fp", vocab_size, k))
    rng = np.random.default_rng(0)
    rows = [RecycledRows(torch.tensor(rng.choice(vocab_size, tree.n, replace=False)),
                         torch.tensor(rng.integers(0, vocab_size, (tree.n, k)), dtype=torch.int32)) for _ in range(64)]
    times = []
    for i in range(steps + 200):
        t0 = time.perf_counter()
        session.step(rows[i % 64], int(rows[i % 64].tokens[0]))
        if i >= 200:  # warm-up excluded
            times.append(time.perf_counter() - t0)
    mode = session.info().mode
    session.close(None)
    source.close()
    us = np.array(times) * 1e6
    return {"tree": tree_name, "nodes": tree.n, "steps": steps, "mode": mode,
            "p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean())}


MODES = ("in-process", "remote", "remote-no-history", "replica")


def conversations(workload: str | None, per_category: int, prompts: int) -> list[tuple[str, list[str]]]:
    """(category, user turns) per conversation: the bundled `workload`'s, `per_category` of each
    category, every turn; or (no workload) the first `prompts` of PROMPTS, one turn each."""
    if workload is None:
        return [("", [p]) for p in PROMPTS[:prompts]]
    from .runner import select_questions
    from ..core.datasets import prompt_file

    return [(q["category"], list(q["turns"])) for q in select_questions(str(prompt_file(workload)), per_category)]


def _source(decoder, mode: str, addr: str, tenant: str):
    """One tenant's draft source in `mode` (a tenant per category: its history is its own)."""
    from ..services.worker.drafting.link import DraftClientConfig
    from ..services.worker.drafting.remote import RemoteDraftSource
    from ..services.worker.drafting.replica import ReplicaDraftSource

    if mode == "in-process":
        return decoder.new_tenant()  # its matrix and history, as an embedded worker keeps them
    if mode == "replica":
        return ReplicaDraftSource(addr, tenant)
    return RemoteDraftSource(addr, tenant, config=DraftClientConfig(history=mode == "remote"))


def end_to_end(addr: str, convs: list[tuple[str, list[str]]], max_new_tokens: int,
               modes: tuple[str, ...] = MODES) -> list[dict]:
    """Tokens/s, MAT and draft tokens per source, per drafting mode over the same conversations
    (each turn after the mode's own answer to the last), one request at a time through a served engine
    (tree sizes from this host's forward costs, as `trserve bench`'s `tr`); each mode's tenants carry
    over conversations."""
    from .report import draft_sources
    from ..engine import Decoder, DecoderConfig, GenerationRequest
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.tuning.cost import engine_cost

    decoder = Decoder(DecoderConfig())
    cost = engine_cost(decoder, measure=True)
    stamp = int(time.time())

    def generate(messages, source):
        return engine.generate(decoder.prepare(GenerationRequest(messages=messages, max_new_tokens=max_new_tokens)),
                               matrix=source)

    results, reference = [], None
    for mode in modes:
        # an engine per mode, as a worker has one per draft mode: what its budget measured (forward speed,
        # each tree step's host time, a remote round trip included) must not carry into another mode's
        engine = BatchEngine(decoder, EngineConfig(max_batch=1), cost)
        generate([{"role": "user", "content": "Hi"}], decoder.new_matrix())  # warm-up
        sources: dict[str, object] = {}
        ids, tokens, seconds, mat, counts = [], 0, 0.0, [], []
        for category, turns in convs:
            if category not in sources:
                sources[category] = _source(decoder, mode, addr, f"bench-{mode}-{category or 'all'}-{stamp}")
            messages: list[dict] = []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                r = generate(messages, sources[category])
                messages.append({"role": "assistant", "content": r.text})
                ids.append(r.ids)
                tokens += r.stats.generated_tokens
                seconds += r.stats.prefill_s + r.stats.decode_s
                mat.append(r.stats.mat)
                counts.append({"drafted": dict(r.stats.drafted), "accepted": dict(r.stats.accepted)})
            time.sleep(0.2)  # a split worker's pusher thread takes the finished requests meanwhile
        for source in sources.values():
            if hasattr(source, "close"):
                source.close()
        reference = reference or ids
        results.append({"mode": mode, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                        "mean_mat": float(np.mean(mat)), "tree": decoder.default_tree.template.name,
                        "draft_sources": draft_sources(counts), "same_ids_as_in_process": ids == reference})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="round trips measured per tree")
    parser.add_argument("--trees", default="paper", help="comma-separated builtin trees for the round trip")
    parser.add_argument("--prompts", type=int, default=3, help=f"prompts for end-to-end (max {len(PROMPTS)}); 0 = skip")
    parser.add_argument("--workload", default=None, help="end to end over this bundled workload's conversations "
                        "(every turn; e.g. repetitive) instead of --prompts")
    parser.add_argument("--per-category", type=int, default=1, help="--workload: conversations per category")
    parser.add_argument("--modes", default=",".join(MODES), help=f"end-to-end drafting modes, of {', '.join(MODES)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--redis-url", default=None, help="snapshot to this Redis (default: memory only)")
    parser.add_argument("--out", default="bench-results/matrix-bench.json")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(2)
    proc, addr = start_service(args.redis_url)
    try:
        rtt = [round_trips(addr, name, args.steps) for name in args.trees.split(",")] if args.steps else []
        convs = conversations(args.workload, args.per_category, args.prompts)
        modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        e2e = end_to_end(addr, convs, args.max_new_tokens, modes) if convs else []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if rtt:
        print(f"\n{'tree':<14}{'nodes':>6}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}  mode")
    for r in rtt:
        print(f"{r['tree']:<14}{r['nodes']:>6}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}{r['mean_us']:>10.0f}  {r['mode']}")
    if e2e:
        print(f"\n{'drafting':<18}{'tokens':>8}{'tok/s':>9}{'MAT':>7}  same ids  accepted/drafted per source")
        for r in e2e:
            by_source = (r["draft_sources"] or {}).get("by_source", {})
            sources = ", ".join(f"{name} {e['accepted']}/{e['drafted']}" for name, e in by_source.items())
            print(f"{r['mode']:<18}{r['tokens']:>8}{r['tokens_per_s']:>9.2f}{r['mean_mat']:>7.2f}  "
                  f"{str(r['same_ids_as_in_process']):<8}  {sources}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"round_trip": rtt, "end_to_end": e2e, "max_new_tokens": args.max_new_tokens, "workload": args.workload,
                               "cpu_threads": torch.get_num_threads()}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
