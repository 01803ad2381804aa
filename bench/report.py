"""Aggregation, the printed table, and the JSON report of a benchmark run."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from .host import host_line

SOURCES = ("matrix", "context", "history")  # the engine's draft sources, in table order (others after)


def _aggregate(rows: list[dict], baseline_tps: float | None, pld_tps: float | None = None) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    tps = tokens / seconds if seconds else 0.0
    steps = [r for r in rows if r["steps"]]
    out = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tps, 3),
           "speedup_vs_hf": round(tps / baseline_tps, 3) if baseline_tps else None,
           "speedup_vs_pld": round(tps / pld_tps, 3) if pld_tps else None,
           "mat": round(sum(r["step_tokens"] for r in steps) / sum(r["steps"] for r in steps), 3) if steps else None}
    sources = draft_sources(rows)
    if sources is not None:
        out["draft_sources"] = sources
    return out


def draft_sources(rows: list[dict]) -> dict | None:
    """Draft tokens per source over the rows that carry `drafted` and `accepted` dicts (source -> count,
    as GenerationStats has them; TR requests only): {"by_source": {source: {"drafted", "accepted",
    "acceptance"}}, "total": {...}}, acceptance = accepted / drafted (None when nothing was drafted).
    None when no row carries them (plain decoding, peers)."""
    rows = [r for r in rows if r.get("drafted") is not None]
    if not rows:
        return None
    drafted, accepted = Counter(), Counter()
    for r in rows:
        drafted.update(r["drafted"])
        accepted.update(r.get("accepted") or {})
    names = sorted(set(drafted) | set(accepted), key=_source_order)

    def entry(d: int, a: int) -> dict:
        return {"drafted": d, "accepted": a, "acceptance": round(a / d, 4) if d else None}

    return {"by_source": {s: entry(drafted[s], accepted[s]) for s in names},
            "total": entry(sum(drafted.values()), sum(accepted.values()))}


def _source_order(name: str) -> tuple[int, str]:
    return (SOURCES.index(name) if name in SOURCES else len(SOURCES), name)


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
    ar_ids = {(r["question_id"], r["turn"]): r["ids"] for r in by_dec.get("ar", [])}
    for name in decoders:
        agg = _aggregate(by_dec[name], hf, pld)
        if sampled:
            agg["identical_to_hf"] = "n/a"
        elif hf_ids:
            # later turns depend on the decoder's own earlier answer, so compare first turns only
            firsts = [r for r in by_dec[name] if r["turn"] == 0]
            agg["identical_to_hf"] = f"{sum(r['ids'] == hf_ids[(r['question_id'], 0)] for r in firsts)}/{len(firsts)}"
        if ar_ids and name != "ar" and not sampled:
            # greedy TR is plain decoding's output on the same server, every turn (each turn's history is
            # the decoder's own earlier answers, the same where they matched)
            same = sum(r["ids"] == ar_ids.get((r["question_id"], r["turn"])) for r in by_dec[name])
            agg["identical_to_ar"] = f"{same}/{len(by_dec[name])}"
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
    env = report.get("environment", {})
    lines = [host_line(env) + (f"; kernels {env['isa']}, {env['arithmetic']}" if env.get("isa") else "")] if env else []
    w = max([12, *(len(name) + 1 for name in decs)])  # llama-server-ngram is long
    lines.append(f"{'decoder':<{w}}{'tok/s':>8}{'vs hf':>8}{'vs pld':>8}{'MAT':>7}{'same as hf':>12}{'same as ar':>12}"
                 f"{'tokens':>8}")
    for name, a in report["decoders"].items():
        lines.append(f"{name:<{w}}{a['tokens_per_s']:>8.2f}{_x(a['speedup_vs_hf']):>8}{_x(a.get('speedup_vs_pld')):>8}"
                     f"{_m(a['mat']):>7}"
                     f"{a.get('identical_to_hf', '-'):>12}{a.get('identical_to_ar', '-'):>12}{a['tokens']:>8}")
    lines.append("")
    lines.append("per category: tok/s (speedup vs hf) [MAT]")
    vs_pld = "tr" in decs and "pld" in decs
    lines.append(f"{'category':<15}" + "".join(f"{d:>22}" for d in decs) + (f"{'tr vs pld':>11}" if vs_pld else ""))
    for cat, per in report["per_category"].items():
        cells = [f"{per[d]['tokens_per_s']:.1f} ({_x(per[d]['speedup_vs_hf'])})" + (f" [{per[d]['mat']:.2f}]" if per[d]["mat"] else "")
                 for d in decs]
        extra = f"{_x(per['tr']['speedup_vs_pld']):>11}" if vs_pld else ""
        lines.append(f"{cat:<15}" + "".join(f"{c:>22}" for c in cells) + extra)
    lines += format_sources(report)
    return "\n".join(lines)


def format_sources(report: dict) -> list[str]:
    """The per-source table (TR decoders only): overall, then per category; [] when no decoder drafted."""
    rows = []
    for name, agg in report["decoders"].items():
        if "draft_sources" in agg:
            rows.append((name, "all", agg["draft_sources"]))
            rows += [(name, cat, per[name]["draft_sources"]) for cat, per in report["per_category"].items()
                     if "draft_sources" in per.get(name, {})]
    if not rows:
        return []
    lines = ["", "draft sources: accepted / drafted tokens (acceptance)"]
    return lines + source_lines([(f"{name:<12}{cat:<15}", src) for name, cat, src in rows], f"{'decoder':<12}{'category':<15}")


def source_lines(rows: list[tuple[str, dict]], head: str) -> list[str]:
    """One line per (label, draft_sources) with a column per source seen in any row, then the total."""
    names = sorted({s for _, src in rows for s in src["by_source"]}, key=_source_order)
    lines = [head + "".join(f"{s:>22}" for s in [*names, "total"])]
    for label, src in rows:
        cells = [_cell(src["by_source"].get(s)) for s in names] + [_cell(src["total"])]
        lines.append(label + "".join(f"{c:>22}" for c in cells))
    return lines


def _cell(e: dict | None) -> str:
    if not e:
        return "-"
    rate = f"{e['acceptance'] * 100:.1f}%" if e["acceptance"] is not None else "-"
    return f"{e['accepted']}/{e['drafted']} ({rate})"


def _x(v):
    return f"{v:.2f}x" if v is not None else "-"


def _m(v):
    return f"{v:.2f}" if v is not None else "-"


def write_report(path: str | Path, report: dict, text: str) -> None:
    """A bench mode's report as JSON at `path` and its table beside it (.txt), the table printed."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    out.with_suffix(".txt").write_text(text + "\n")
    print(text)


def write_outputs(report: dict, records: list[dict], path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    table = format_table(report)
    out.with_suffix(".txt").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.txt')}")
