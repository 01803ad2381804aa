"""Structured output under TR: `trserve bench --structured` (issue 44).

The bundled extraction set (core/data/structured/: 24 requests, each with the JSON Schema its
answer must follow) decoded one request at a time under its schema by three modes, each its own
tenant (its own matrix, hot across the run's requests as one service's traffic would make it):

- `ar`: plain decoding under the grammar (one token per forward);
- `tr`: Token Recycling with grammar-aware drafting (forced tokens drafted as a chain, forbidden
  drafts cut: engine/drafting/constrained.py);
- `tr-plain-drafts`: Token Recycling under the same grammar, drafting as without one.

Per mode: tokens, seconds, tok/s, mean accepted tokens per step (MAT), the share of answers that are
complete JSON following their schema's required keys, and whether its ids equal `ar`'s on every
request (the lossless contract). The first request of each mode is a warm-up, not counted.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

log = logging.getLogger("trserve.bench")

MODES = ("ar", "tr", "tr-plain-drafts")


@dataclass(frozen=True)
class StructuredConfig:
    prompts: str  # the structured set's format: question_id, category, turns, schema
    max_new_tokens: int = 160
    kernels: str = "auto"
    arithmetic: str = "auto"
    threads: int | None = None
    json_path: str = "bench-results/structured.json"
    model: str | None = None  # `--model` (None: the bundled model)


def run_structured(config: StructuredConfig) -> dict:
    from .host import host_facts
    from ..engine import Decoder, DecoderConfig, GenerationRequest
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.model.loader import ModelConfig
    from ..engine.tr.grammar import StructuredOutput

    decoder = Decoder(DecoderConfig(model=ModelConfig(**({"source": config.model} if config.model else {}),
                                                      kernels=config.kernels, arithmetic=config.arithmetic,
                                                      threads=config.threads)))
    questions = [json.loads(line) for line in Path(config.prompts).read_text().splitlines() if line.strip()]
    engines = {mode: BatchEngine(decoder, EngineConfig(max_batch=1,
                                                       grammar_drafting=mode != "tr-plain-drafts")) for mode in MODES}
    tenants = {mode: decoder.new_tenant() for mode in MODES}
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i, q in enumerate(questions):
        request = GenerationRequest(messages=[{"role": "user", "content": q["turns"][0]}],
                                    max_new_tokens=config.max_new_tokens,
                                    structured=StructuredOutput("json_schema", json.dumps(q["schema"])))
        for mode in MODES:  # the modes take turns per request
            prepared = decoder.prepare(replace(request, mode="ar" if mode == "ar" else "tr"))
            t0 = time.perf_counter()
            out = engines[mode].generate(prepared, matrix=tenants[mode])
            seconds = time.perf_counter() - t0
            rows[mode].append({"question_id": q["question_id"], "category": q["category"], "ids": out.ids,
                               "seconds": seconds, "steps": out.stats.steps, "finish": out.finish_reason,
                               "valid": _complete(decoder.tokenizer.decode(out.ids, skip_special_tokens=True),
                                                  q["schema"]), "warm_up": i == 0})
        log.info("structured: request %d/%d", i + 1, len(questions))
    report = {"config": config.__dict__, "host": host_facts(), "requests": len(questions) - 1,
              "modes": {mode: _summary(rows[mode], rows["ar"]) for mode in MODES}}
    Path(config.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(config.json_path).write_text(json.dumps({**report, "rows": rows}, indent=1))
    print(table(report))
    return report


def _complete(text: str, schema: dict) -> bool:
    """The answer parses as JSON with every required key of its schema."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(schema.get("required", ())) <= value.keys()


def _summary(rows: list[dict], ar: list[dict]) -> dict:
    timed = [r for r in rows if not r["warm_up"]]
    tokens, seconds, steps = (sum(len(r["ids"]) if k == "ids" else r[k] for r in timed) for k in ("ids", "seconds", "steps"))
    return {"tokens": tokens, "seconds": round(seconds, 3), "tok_per_s": round(tokens / seconds, 2),
            "mat": round(tokens / steps, 3), "valid_share": sum(r["valid"] for r in timed) / len(timed),
            "ids_equal_ar": all(r["ids"] == a["ids"] for r, a in zip(rows, ar))}


def table(report: dict) -> str:
    ar = report["modes"]["ar"]["tok_per_s"]
    lines = [f"structured output (JSON Schema extraction), {report['requests']} requests one at a time "
             f"({report['host']['cpu']}; {' '.join(report['host']['isa_flags'])}; threads {report['host']['threads']})",
             f"{'mode':<17}{'tokens':>8}{'tok/s':>9}{'vs ar':>7}{'MAT':>7}{'valid':>8}  ids == ar"]
    for name, m in report["modes"].items():
        lines.append(f"{name:<17}{m['tokens']:>8}{m['tok_per_s']:>9.1f}{m['tok_per_s'] / ar:>6.2f}x{m['mat']:>7.2f}"
                     f"{100 * m['valid_share']:>7.0f}%  {'yes' if m['ids_equal_ar'] else 'NO'}")
    return "\n".join(lines)
