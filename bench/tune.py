"""`trserve tune`: measure this device and these prompts, write the tree that decodes fastest here.

1. calibrate the forward cost per width (cached per model/device/threads/kernels);
2. decode the tuning prompts with a large universe tree (default: the paper's 80 nodes) and
   full-length prompt-lookup chains, recording per step which nodes and chain tokens the model
   accepted (one matrix kept hot, as in serving);
3. search every subtree size and chain cap for the best predicted tokens/s (engine/tune.py);
4. write the tree JSON (usable as `--tree FILE` everywhere) and print the size/throughput table.
Use prompts that are not your benchmark prompts: by default the *last* N per category.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("trserve.tune")


@dataclass(frozen=True)
class TuneConfig:
    prompts: tuple[str, ...]
    out: str
    per_category: int = 2
    max_new_tokens: int = 128
    universe: str = "paper"
    max_ngram: int = 4
    max_chain: int = 16
    max_nodes: int = 64
    recalibrate: bool = False
    threads: int | None = None
    model: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts or any(not Path(p).exists() for p in self.prompts):
            raise ValueError(f"prompts files must exist, got {list(self.prompts)}")
        if self.per_category < 1 or self.max_new_tokens < 1 or self.max_nodes < 1:
            raise ValueError("per_category, max_new_tokens and max_nodes must be >= 1")
        if not 0 <= self.max_ngram <= 8 or not 1 <= self.max_chain <= 32:
            raise ValueError("max_ngram must be in [0, 8] (0 = no lookup) and max_chain in [1, 32]")


def tuning_prompts(paths: tuple[str, ...], per_category: int) -> list[str]:
    """First turns of the last `per_category` questions of each category (benchmarks use the first ones)."""
    by_cat: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                by_cat[q.get("category", path)].append(q["turns"][0])
    return [p for cat in by_cat for p in by_cat[cat][-per_category:]]


def run_tune(config: TuneConfig) -> dict:
    import numpy as np
    import torch

    from engine import Decoder, DecoderConfig, ModelConfig
    from engine.acceptance import AcceptanceLog
    from engine.calibrate import load_or_measure
    from engine.model_loader import default_cache_dir
    from engine.tree import TreeTemplate, load_template
    from engine.tune import tune

    model_cfg = ModelConfig(**({"source": config.model} if config.model else {}), threads=config.threads)
    decoder = Decoder(DecoderConfig(model=model_cfg))
    cost = load_or_measure(decoder.loaded, default_cache_dir(), force=config.recalibrate)
    print(cost.table())
    base = load_template(config.universe)
    universe = TreeTemplate.from_paths(f"{base.name}+lookup", base.paths,
                                       lookup=[config.max_chain] * config.max_ngram)
    compiled = decoder.compile(universe)
    acceptance = AcceptanceLog(universe)
    matrix = decoder.new_matrix()
    decoder.generate(messages=[{"role": "user", "content": "Explain why the sky is blue."}], max_new_tokens=32,
                     matrix=matrix, tree=compiled)
    prompts = tuning_prompts(config.prompts, config.per_category)
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        r = decoder.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=config.max_new_tokens,
                             matrix=matrix, tree=compiled, acceptance=acceptance)
        log.info("prompt %d/%d: %d tokens, MAT %.2f", i + 1, len(prompts), r.stats.generated_tokens, r.stats.mat)
    rec = acceptance.arrays()
    path_nodes = compiled.path_nodes.cpu().numpy()
    baselines = {name: load_template(name) for name in ("cpu-8", "paper")}
    result = tune(rec, universe, path_nodes, cost, name=config.name or Path(config.out).stem,
                  max_nodes=config.max_nodes, max_ngram=config.max_ngram, baselines=baselines)
    summary = {
        "device": str(decoder.device), "threads": torch.get_num_threads(), "calibration": cost.key,
        "prompts": len(prompts), "steps": int(rec["node"].size), "record_s": round(time.perf_counter() - t0, 1),
        "predicted_tokens_per_s": round(result.tokens_per_s, 2), "predicted_mat": round(result.mat, 3),
        "baselines_tokens_per_s": {k: round(v, 2) for k, v in result.baseline.items()},
        "nodes": result.template.size, "lookup": list(result.template.lookup),
        "steps_with_proposal": int((rec["ngram"] > 0).sum()), "mean_run": float(np.mean(rec["run"][rec["ngram"] > 0]))
        if (rec["ngram"] > 0).any() else 0.0,
    }
    template = TreeTemplate.from_paths(result.template.name, result.template.paths, _describe(summary),
                                       result.template.lookup)
    Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    Path(config.out).write_text(template.to_json() + "\n")
    print(_size_table(result.by_size))
    print(json.dumps(summary, indent=2))
    print(f"wrote {config.out}: {template.size} nodes, lookup chains {list(template.lookup)}")
    return summary


def _describe(s: dict) -> str:
    return (f"tuned by `trserve tune` on {s['device']} ({s['threads']} threads) from {s['steps']} steps over "
            f"{s['prompts']} prompts: predicted {s['predicted_tokens_per_s']} tok/s of verification, MAT "
            f"{s['predicted_mat']} (same steps: {s['baselines_tokens_per_s']})")


def _size_table(by_size: list[tuple[int, float, float]]) -> str:
    lines = ["nodes  pred tok/s   MAT"]
    lines += [f"{n:>5}  {tps:10.2f}  {mat:5.2f}" for n, tps, mat in by_size]
    return "\n".join(lines)


def register(sub) -> None:
    from bench.cli import DEFAULT_PROMPTS

    p = sub.add_parser("tune", help="calibrate this device and write the fastest draft tree for it")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="comma list of Spec-Bench style jsonl files")
    p.add_argument("--out", required=True, help="where to write the tree JSON (use it with --tree FILE)")
    p.add_argument("--per-category", type=int, default=2, help="tuning prompts: the LAST N of each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--universe", default="paper", help="the large tree whose subtrees are searched")
    p.add_argument("--max-ngram", type=int, default=4, help="longest prompt-lookup suffix match (0 = no lookup)")
    p.add_argument("--max-chain", type=int, default=16, help="longest lookup chain recorded")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree considered")
    p.add_argument("--recalibrate", action="store_true", help="measure the forward cost again")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--name", default=None, help="tree name (default: the output file's stem)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    config = TuneConfig(
        prompts=tuple(s.strip() for s in args.prompts.split(",") if s.strip()), out=args.out,
        per_category=args.per_category, max_new_tokens=args.max_new_tokens, universe=args.universe,
        max_ngram=args.max_ngram, max_chain=args.max_chain, max_nodes=args.max_nodes,
        recalibrate=args.recalibrate, threads=args.threads, model=args.model, name=args.name,
    )
    run_tune(config)
    return 0
