"""Aggregation, the printed table, and the JSON report of a benchmark run."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def _aggregate(rows: list[dict], baseline_tps: float | None, pld_tps: float | None = None) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    tps = tokens / seconds if seconds else 0.0
    steps = [r for r in rows if r["steps"]]
    out = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tps, 3),
           "speedup_vs_hf": round(tps / baseline_tps, 3) if baseline_tps else None,
           "speedup_vs_pld": round(tps / pld_tps, 3) if pld_tps else None,
           "mat": round(sum(r["step_tokens"] for r in steps) / sum(r["steps"] for r in steps), 3) if steps else None}
    return out


def summarise(records: list[dict], decoders: list[str], sampled: bool = False) -> dict:
    """Per decoder and per category; `identical_to_hf` is n/a when sampling (outputs are random)."""
    by_dec: dict[str, list[dict]] = defaultdict(list)
    by_cat: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_dec[r["decoder"]].append(r)
        by_cat[r["category"]][r["decoder"]].append(r)
    hf = _aggregate(by_dec["hf"], None)["tokens_per_s"] if "hf" in by_dec else None
    pld = _aggregate(by_dec["pld"], None)["tokens_per_s"] if "pld" in by_dec else None
    report = {"decoders": {}, "per_category": {}, "outputs": {}}
    hf_ids = {(r["question_id"], r["turn"]): r["ids"] for r in by_dec.get("hf", [])}
    for name in decoders:
        agg = _aggregate(by_dec[name], hf, pld)
        if sampled:
            agg["identical_to_hf"] = "n/a"
        elif hf_ids:
            # later turns depend on the decoder's own earlier answer, so compare first turns only
            firsts = [r for r in by_dec[name] if r["turn"] == 0]
            agg["identical_to_hf"] = f"{sum(r['ids'] == hf_ids[(r['question_id'], 0)] for r in firsts)}/{len(firsts)}"
        report["decoders"][name] = agg
        report["outputs"][name] = {}
        for r in by_dec[name]:
            report["outputs"][name].setdefault(str(r["question_id"]), []).extend(r["ids"])
    for cat, decs in by_cat.items():
        cat_hf = _aggregate(decs["hf"], None)["tokens_per_s"] if "hf" in decs else None
        cat_pld = _aggregate(decs["pld"], None)["tokens_per_s"] if "pld" in decs else None
        report["per_category"][cat] = {name: _aggregate(decs[name], cat_hf, cat_pld) for name in decoders}
    return report


def format_table(report: dict) -> str:
    decs = list(report["decoders"])
    lines = [f"{'decoder':<12}{'tok/s':>8}{'vs hf':>8}{'vs pld':>8}{'MAT':>7}{'same as hf':>12}{'tokens':>8}"]
    for name, a in report["decoders"].items():
        lines.append(f"{name:<12}{a['tokens_per_s']:>8.2f}{_x(a['speedup_vs_hf']):>8}{_x(a.get('speedup_vs_pld')):>8}"
                     f"{_m(a['mat']):>7}"
                     f"{a.get('identical_to_hf', '-'):>12}{a['tokens']:>8}")
    lines.append("")
    lines.append("per category: tok/s (speedup vs hf) [MAT]")
    vs_pld = "tr" in decs and "pld" in decs
    lines.append(f"{'category':<15}" + "".join(f"{d:>22}" for d in decs) + (f"{'tr vs pld':>11}" if vs_pld else ""))
    for cat, per in report["per_category"].items():
        cells = [f"{per[d]['tokens_per_s']:.1f} ({_x(per[d]['speedup_vs_hf'])})" + (f" [{per[d]['mat']:.2f}]" if per[d]["mat"] else "")
                 for d in decs]
        extra = f"{_x(per['tr']['speedup_vs_pld']):>11}" if vs_pld else ""
        lines.append(f"{cat:<15}" + "".join(f"{c:>22}" for c in cells) + extra)
    return "\n".join(lines)


def _x(v):
    return f"{v:.2f}x" if v is not None else "-"


def _m(v):
    return f"{v:.2f}" if v is not None else "-"


def write_outputs(report: dict, records: list[dict], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    table = format_table(report)
    out.with_suffix(".txt").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.txt')}")
