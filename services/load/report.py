"""What a load run measured: one record per request, and the summary `trserve load` prints."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class RequestRecord:
    index: int  # the request's number in the run
    tenant: str
    prompt: int  # index into PROMPTS
    code: str  # "OK" or the final gRPC status code name
    latency_s: float  # the whole call, retries included
    addr: str | None  # the worker that answered (None when it failed)
    retried_after: tuple[str, ...] = ()  # status codes of the workers tried before the one that answered
    tokens: int = 0  # generated tokens
    mat: float = 0.0  # mean accepted tokens per step
    draft_mode: str = ""
    text: str = ""


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list, q in [0, 100]. Example: [1, 2, 3, 4], 50 -> 2."""
    if not sorted_values:
        return 0.0
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n * q / 100), at least 1
    return sorted_values[int(rank) - 1]


@dataclass
class LoadReport:
    records: list[RequestRecord]
    wall_s: float  # first request sent .. last reply received
    addrs: list[str]
    concurrency: int
    stopped_early: bool = False  # the duration bound ended the run before every request was sent
    summary: dict = field(init=False)

    def __post_init__(self) -> None:
        self.summary = self._summarize()

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.code == "OK"]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.code != "OK"]

    def _summarize(self) -> dict:
        ok = self.ok
        latencies = sorted(r.latency_s for r in ok)
        tokens = sum(r.tokens for r in ok)
        per_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
        for r in ok:
            per_tenant[r.tenant].append(r)
        wall = max(self.wall_s, 1e-9)
        return {
            "workers": self.addrs, "concurrency": self.concurrency, "requests": len(self.records),
            "ok": len(ok), "failed": len(self.failed), "stopped_early": self.stopped_early,
            "errors_by_code": dict(Counter(r.code for r in self.failed)),
            "retried": sum(bool(r.retried_after) for r in ok),
            "retried_after": dict(Counter(code for r in ok for code in r.retried_after)),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(len(ok) / wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "generated_tokens": tokens,
            "latency_s": {f"p{q}": round(percentile(latencies, q), 3) for q in (50, 90, 99)}
            | {"max": round(latencies[-1], 3) if latencies else 0.0},
            "by_worker": dict(Counter(r.addr for r in ok)),
            "mat_by_tenant": {t: round(sum(r.mat for r in rs) / len(rs), 3) for t, rs in sorted(per_tenant.items())},
            "draft_modes": dict(Counter(r.draft_mode for r in ok)),
        }

    def to_json(self, with_records: bool = False) -> dict:
        out = dict(self.summary)
        if with_records:
            out["records"] = [asdict(r) for r in self.records]
        return out

    def format(self) -> str:
        s = self.summary
        lat = s["latency_s"]
        lines = [
            f"workers      {', '.join(s['workers'])} (concurrency {s['concurrency']})",
            f"requests     {s['ok']} ok, {s['failed']} failed of {s['requests']}"
            + (" (stopped early: duration bound)" if s["stopped_early"] else "")
            + f"; {s['retried']} retried on another worker" + (f" after {s['retried_after']}" if s["retried"] else ""),
            f"throughput   {s['requests_per_s']:.2f} req/s, {s['tokens_per_s']:.1f} tok/s over {s['wall_s']:.1f} s",
            f"latency      p50 {lat['p50']:.2f} s, p90 {lat['p90']:.2f} s, p99 {lat['p99']:.2f} s, "
            f"max {lat['max']:.2f} s",
            f"errors       {s['errors_by_code'] or 'none'}",
            f"by worker    {s['by_worker']}",
            f"draft modes  {s['draft_modes']}",
            "MAT by tenant " + ", ".join(f"{t} {m:.2f}" for t, m in s["mat_by_tenant"].items()),
        ]
        return "\n".join(lines)
