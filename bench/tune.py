"""`trserve tune`: measure this device and these prompts, write the tree that decodes fastest here.

1. calibrate the forward cost per width (cached per model/device/threads/kernels);
2. decode the tuning prompts with a large universe tree (default: the paper's 80 nodes) and
   full-length prompt-lookup chains, recording per step which nodes and chain tokens the model
   accepted (one matrix kept hot, as in serving);
3. search every subtree size and chain cap for the best predicted tokens/s (engine/tuning/optimise.py);
4. write the tree JSON (usable as `--tree FILE` everywhere) and print the size/throughput table.
Use prompts that are not your benchmark prompts: by default the *last* N per category.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ..core.progress import Progress
from ..engine.model.choices import ARITHMETIC_CHOICES, QUANTIZE_CHOICES

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
    records: str | None = None  # .npz of step records: loaded if it exists (no decoding), else written
    confirm: int = 4  # finalists (best per size band) decoded with their own tree (0 = trust the universe replay)
    threads: int | None = None
    kernels: str = "auto"
    model: str | None = None
    name: str | None = None
    arithmetic: str = "auto"  # the compressed kernels' arithmetic (ModelConfig); trees are tuned per arithmetic
    quantize: str = "auto"  # a checkpoint's linears quantized at load (ModelConfig.quantize)

    def __post_init__(self) -> None:
        if not self.prompts or any(not Path(p).exists() for p in self.prompts):
            raise ValueError(f"prompts files must exist, got {list(self.prompts)}")
        if self.per_category < 1 or self.max_new_tokens < 1 or self.max_nodes < 1:
            raise ValueError("per_category, max_new_tokens and max_nodes must be >= 1")
        if self.confirm < 0:
            raise ValueError(f"confirm must be >= 0, got {self.confirm}")
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
    import torch

    from ..engine import Decoder, DecoderConfig, ModelConfig
    from ..engine.model.paths import default_cache_dir
    from ..engine.tr.tree import TreeTemplate, load_template
    from ..engine.tuning.calibrate import load_or_measure
    from ..engine.tuning.optimise import tune

    model_cfg = ModelConfig(**({"source": config.model} if config.model else {}), threads=config.threads,
                            kernels=config.kernels, arithmetic=config.arithmetic, quantize=config.quantize)
    decoder = Decoder(DecoderConfig(model=model_cfg))
    cost = load_or_measure(decoder.loaded, default_cache_dir(), force=config.recalibrate)
    print(cost.table())
    base = load_template(config.universe)
    universe = TreeTemplate.from_paths(f"{base.name}+lookup", base.paths,
                                       lookup=[config.max_chain] * config.max_ngram)
    compiled = decoder.compile(universe)
    prompts = tuning_prompts(config.prompts, config.per_category)
    rec = _universe_records(decoder, compiled, prompts, config)
    result = tune(rec, universe, compiled.path_nodes.cpu().numpy(), cost, name=config.name or Path(config.out).stem,
                  max_nodes=config.max_nodes, max_ngram=config.max_ngram,
                  baselines={name: load_template(name) for name in ("cpu-8", "paper")})
    print(_size_table(result.by_size))
    # Stage 2: small trees recycle fewer rows than the universe did, so their real acceptance is
    # lower than replayed; decode with each finalist and score it on its own records.
    finalists = result.finalists()[: config.confirm] + [load_template("cpu-8")] if config.confirm else [result.template]
    confirmed = [_confirm(decoder, cost, t, prompts, config.max_new_tokens) for t in finalists]
    best = max(confirmed, key=lambda row: row["tokens_per_s"])
    summary = {
        "device": str(decoder.device), "threads": torch.get_num_threads(), "calibration": cost.key,
        "prompts": len(prompts), "universe_steps": int(rec["node"].size),
        "predicted_from_universe": {"tokens_per_s": round(result.tokens_per_s, 2), "mat": round(result.mat, 3),
                                    "baselines_tokens_per_s": {k: round(v, 2) for k, v in result.baseline.items()}},
        "confirmed": [{k: v for k, v in row.items() if k != "template"} for row in confirmed],
        "chosen": {"nodes": best["template"].size, "lookup": list(best["template"].lookup),
                   "tokens_per_s": best["tokens_per_s"], "mat": best["mat"]},
    }
    chosen = best["template"]
    template = TreeTemplate.from_paths(config.name or Path(config.out).stem, chosen.paths, _describe(summary),
                                       chosen.lookup)
    Path(config.out).parent.mkdir(parents=True, exist_ok=True)
    Path(config.out).write_text(template.to_json() + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {config.out}: {template.size} nodes, lookup chains {list(template.lookup)}")
    return summary


def _universe_records(decoder, compiled, prompts: list[str], config: TuneConfig) -> dict:
    import numpy as np

    if config.records and Path(config.records).exists():
        rec = dict(np.load(config.records))
        log.info("loaded %d step records from %s (no decoding)", rec["node"].size, config.records)
        return rec
    rec = _record(decoder, compiled, prompts, config.max_new_tokens)
    if config.records:
        np.savez(config.records, **rec)
    return rec


def _confirm(decoder, cost, template, prompts: list[str], max_new_tokens: int) -> dict:
    """Decode with `template` itself and replay its own records: tokens/s under the cost model."""
    import numpy as np

    from ..engine.tuning.optimise import evaluate

    compiled = decoder.compile(template)
    rec = _record(decoder, compiled, prompts, max_new_tokens)
    tps, mat = evaluate(rec, compiled.path_nodes.cpu().numpy(), np.ones(compiled.n, dtype=bool), template.lookup, cost)
    row = {"template": template, "nodes": template.size, "lookup": list(template.lookup),
           "tokens_per_s": round(tps, 2), "mat": round(mat, 3)}
    log.info("confirmed %s", {k: v for k, v in row.items() if k != "template"})
    return row


def _record(decoder, compiled, prompts: list[str], max_new_tokens: int) -> dict:
    """Decode the prompts with the universe tree, one hot matrix, recording every step."""
    from ..engine.tuning.records import AcceptanceLog

    acceptance = AcceptanceLog(compiled.template)
    matrix = decoder.new_matrix()
    decoder.generate(messages=[{"role": "user", "content": "Explain why the sky is blue."}], max_new_tokens=32,
                     matrix=matrix, tree=compiled)
    name = compiled.template.name
    with Progress(f"tune {name}", total=len(prompts), unit="prompts", every_s=0.0, logger=log) as progress:
        for prompt in prompts:
            r = decoder.generate(messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new_tokens,
                                 matrix=matrix, tree=compiled, acceptance=acceptance)
            progress.add(name, r.stats.generated_tokens, r.stats.prefill_s + r.stats.decode_s)
            progress.step(note=f"MAT {r.stats.mat:.2f}")
    return acceptance.arrays()


def _describe(s: dict) -> str:
    c = s["chosen"]
    others = ", ".join(f"{r['nodes']} nodes {r['lookup']}: {r['tokens_per_s']}" for r in s["confirmed"])
    return (f"tuned by `trserve tune` on {s['device']} ({s['threads']} threads), {s['prompts']} prompts: "
            f"{c['tokens_per_s']} tok/s of verification under the calibrated cost, MAT {c['mat']} "
            f"(finalists, own records: {others})")


def _size_table(by_size) -> str:
    lines = ["nodes  pred tok/s   MAT  lookup"]
    lines += [f"{t.size:>5}  {tps:10.2f}  {mat:5.2f}  {list(t.lookup)}" for t, tps, mat in by_size]
    return "\n".join(lines)


def register(sub) -> None:
    from ..core.datasets import prompt_file

    p = sub.add_parser("tune", help="calibrate this device and write the fastest draft tree for it")
    p.add_argument("--prompts", default=str(prompt_file("spec_bench")), help="comma list of Spec-Bench style jsonl files")
    p.add_argument("--out", required=True, help="where to write the tree JSON (use it with --tree FILE)")
    p.add_argument("--per-category", type=int, default=2, help="tuning prompts: the LAST N of each category")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per tuning prompt (default 128)")
    p.add_argument("--universe", default="paper", help="the large tree whose subtrees are searched")
    p.add_argument("--max-ngram", type=int, default=4, help="longest prompt-lookup suffix match (0 = no lookup)")
    p.add_argument("--max-chain", type=int, default=16, help="longest lookup chain recorded")
    p.add_argument("--max-nodes", type=int, default=64, help="largest tree considered")
    p.add_argument("--recalibrate", action="store_true", help="measure the forward cost again")
    p.add_argument("--records", default=None, help="universe step records .npz: reused if it exists, else written")
    p.add_argument("--confirm", type=int, default=4,
                   help="finalists (the best of sizes 1-4, 5-8, 9-16, 17-32) decoded with their own tree, "
                        "and cpu-8 for reference; 0 = skip")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--kernels", default="auto", choices=("auto", "stock", "packed", "compressed"),
                   help="kernels to tune for (default auto, as `serve` picks them)")
    p.add_argument("--arithmetic", default="auto", choices=ARITHMETIC_CHOICES,
                   help="the compressed kernels' arithmetic to tune for: auto (default: as a worker serves), exact or int8")
    p.add_argument("--quantize", default="auto", choices=QUANTIZE_CHOICES,
                   help="a checkpoint --model's linears quantized at load, as `serve --quantize` (default auto)")
    p.add_argument("--model", default=None, help="model source (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--name", default=None, help="tree name (default: the output file's stem)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    config = TuneConfig(
        prompts=tuple(s.strip() for s in args.prompts.split(",") if s.strip()), out=args.out,
        per_category=args.per_category, max_new_tokens=args.max_new_tokens, universe=args.universe,
        max_ngram=args.max_ngram, max_chain=args.max_chain, max_nodes=args.max_nodes,
        recalibrate=args.recalibrate, records=args.records, confirm=args.confirm, threads=args.threads, kernels=args.kernels, model=args.model, name=args.name,
        arithmetic=args.arithmetic, quantize=args.quantize,
    )
    run_tune(config)
    return 0
