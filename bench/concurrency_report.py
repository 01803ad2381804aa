"""The concurrency bench's tables and plot (bench/concurrency.py measures; this formats)."""

from __future__ import annotations

import logging
from pathlib import Path

from .report import source_lines

log = logging.getLogger("trserve.bench")


def format_table(rows: list[dict]) -> str:
    m = max([8, *(len(r["mode"]) + 1 for r in rows)])  # the mode column: llama-server-ngram is long
    lines = [f"{'mode':<{m}}{'conc':>5}{'reqs':>6}{'tok/s':>9}{'req/s':>8}{'p50 lat':>9}{'p99 lat':>9}{'p50 ttft':>10}{'p99 ttft':>10}{'MAT':>6}{'prefill':>9}{'decode tok/s':>14}"]
    for r in rows:
        lines.append(f"{r['mode']:<{m}}{r['concurrency']:>5}{r['requests']:>6}{r['tokens_per_s']:>9.1f}"
                     f"{r['requests_per_s']:>8.2f}{r['latency_p50_s']:>8.2f}s{r['latency_p99_s']:>8.2f}s"
                     f"{r['ttft_p50_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s{r['mat']:>6.2f}"
                     f"{r['prefill_share'] * 100:>8.0f}%{r['decode_tokens_per_s']:>14.1f}")
    return "\n".join(lines)


def format_sources(rows: list[dict]) -> str:
    """Draft tokens per source of the TR modes' levels, after a blank line, to append to a table ("" when
    no row has them)."""
    sources = [(f"{r['mode']:<8}{r['concurrency']:>5}", r["draft_sources"]) for r in rows if "draft_sources" in r]
    if not sources:
        return ""
    return "\n\n" + "\n".join(["draft sources: accepted / drafted tokens (acceptance)",
                                *source_lines(sources, f"{'mode':<8}{'conc':>5}")])


def format_runs(rows: list[dict]) -> str:
    """Each run's tr/ar tokens/s ratio per level, after a blank line ("" unless rows list their runs
    and both modes ran): the spread that one summed figure hides."""
    per = {(r["mode"], r["concurrency"]): r.get("runs_tokens_per_s") for r in rows}
    lines = []
    for c in dict.fromkeys(r["concurrency"] for r in rows):
        tr, ar = per.get(("tr", c)), per.get(("ar", c))
        if tr and ar:
            ratios = [t / a for t, a in zip(tr, ar)]
            lines.append(f"{c:>5}  " + " ".join(f"{x:.2f}" for x in ratios) + f"   (min {min(ratios):.2f})")
    return "\n\ntr/ar tokens/s per run\n conc  runs\n" + "\n".join(lines) if lines else ""


def plot(rows: list[dict], path: Path) -> None:
    """Throughput and p99 latency against concurrency, per mode (PNG; needs matplotlib, else skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        xs = [r["concurrency"] for r in mine]
        a.plot(xs, [r["tokens_per_s"] for r in mine], marker="o", label=mode)
        b.plot(xs, [r["latency_p99_s"] for r in mine], marker="o", label=mode)
    for ax, title in ((a, "aggregate tokens/s"), (b, "p99 request latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
