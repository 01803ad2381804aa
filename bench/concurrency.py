"""`trserve bench --concurrency 1,2,4,8,16`: throughput and latency of the batching engine under
closed-loop load, in one process (no gRPC: the engine is what is measured).

At concurrency c, c clients each send a request, and the next one as soon as theirs finishes,
until `requests(c)` have run; 4 tenants in turn, each with its own hot matrix. First turns only,
unless `all_turns` (a client then sends a question's next turn after its own answer to the last,
each turn one request), and `tenant_per_category` makes every category one tenant instead
(`trserve bench --workload repetitive` sets both). Modes: `tr` (batched, batch-aware trees), `ar`
(batched plain decoding, the same kernels), `serial` (one request at a time: a FIFO queue in front
of `Decoder.generate`, whose engine takes one request and verifies its whole tree each step), and on
request `tr-full` (batched TR with the budget off: every request verifies its whole tree each step,
as `trserve serve --full-trees`; what the budget gains or loses). Per level:
aggregate tokens/s, requests/s, latency and time-to-first-token percentiles, mean accepted tokens,
the share of the level's time spent in prompt forwards and the tokens/s of the rest (decoding), and
for TR modes the draft tokens per source (drafted, accepted). With `repeats` > 1 every level runs
that many times, the modes taking turns each time, each run from the matrices the level started
with (a copy: the same prompts sent again must not find their own answers in them); a row sums its
runs and lists each run's tokens/s, and the table ends with each run's `tr`/`ar` ratio (one run's
ratio moves by 5% or more from the next on these shared hosts).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .concurrency_report import format_runs, format_sources, format_table, plot
from .host import host_facts, host_line
from .report import draft_sources

log = logging.getLogger("trserve.bench")
SERVERS = ("llama-server", "llama-server-ngram")  # llama.cpp's own server, plain and n-gram (bench/llama_server.py)
MODES = ("tr", "ar", "serial", "tr-full", *SERVERS)
Turn = tuple[str, list[dict], list[str]]  # (tenant, messages of this request, the conversation's user turns left)


@dataclass(frozen=True)
class ConcurrencyConfig:
    prompts: str
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    modes: tuple[str, ...] = ("tr", "ar", "serial")
    max_new_tokens: int = 64
    min_requests: int = 32  # per level: max(min_requests, 2 * concurrency) requests, the same prompts every level
    prefill_chunk: int = 128
    tenants: int = 4
    kernels: str = "auto"
    arithmetic: str = "auto"  # the compressed kernels' arithmetic (ModelConfig; the report's config names it)
    threads: int | None = None
    json_path: str = "bench-results/concurrency.json"
    all_turns: bool = False  # send every turn of a question (each after the client's own answer), not only the first
    tenant_per_category: bool = False  # a tenant per category (its requests share a matrix), not `tenants` in turn
    repeats: int = 1  # runs per level (the modes take turns each time); rows sum them
    model: str | None = None  # `--model` (None: the bundled model)

    def __post_init__(self) -> None:
        if not self.levels or min(self.levels) < 1 or set(self.modes) - set(MODES) or not self.modes or self.repeats < 1:
            raise ValueError(f"levels and repeats must be >= 1 and modes a subset of {MODES}")
        if not Path(self.prompts).exists():
            raise ValueError(f"prompts file {self.prompts!r} not found")

    def requests(self, c: int) -> int:
        return max(self.min_requests, 2 * c)


def _mixed(path: str) -> list[dict]:
    """The questions, categories interleaved (the file is sorted by category): every level sees a mix."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[dict]] = {}
    for r in rows:
        by_cat.setdefault(r.get("category", ""), []).append(r)
    return [r for group in itertools.zip_longest(*by_cat.values()) for r in group if r is not None]


def _prompts(path: str) -> list[list[dict]]:
    """First turns, categories interleaved."""
    return [[{"role": "user", "content": r["turns"][0]}] for r in _mixed(path)]


def conversations(path: str, config: ConcurrencyConfig) -> list[tuple[str, list[str]]]:
    """(tenant, user turns) per question, categories interleaved: the tenant is the category
    (config.tenant_per_category) or the n-th question's n % config.tenants; every turn (config.all_turns)
    or the first."""
    return [(r.get("category", "") if config.tenant_per_category else str(i % config.tenants),
             list(r["turns"]) if config.all_turns else [r["turns"][0]]) for i, r in enumerate(_mixed(path))]


def _opening(feed) -> Turn:
    tenant, turns = next(feed)
    return tenant, [{"role": "user", "content": turns[0]}], turns[1:]


def _follow(feed, turn: Turn, answer: str) -> Turn:
    """A client's next request: its conversation's next turn after its own answer, else a new conversation."""
    tenant, messages, rest = turn
    if not rest:
        return _opening(feed)
    return tenant, [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": rest[0]}], rest[1:]


def _done(stats, tokens: int, latency: float, ttft: float, sources: bool) -> dict:
    """One finished request; `sources`: with its draft tokens per source (TR modes)."""
    out = {"tokens": tokens, "latency": latency, "ttft": ttft, "mat": stats.mat}
    if sources:
        out.update(drafted=dict(stats.drafted), accepted=dict(stats.accepted))
    return out


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else 0.0


def _summary(mode: str, c: int, done: list[dict], wall: float, prefill_s: float) -> dict:
    """prefill_s: seconds of the level spent in prompt forwards (the serial decoder's own prefill
    times); decode tok/s is the level's tokens over the rest, the part batching can share."""
    tokens = sum(r["tokens"] for r in done)
    lat = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in done]
    row = {"mode": mode, "concurrency": c, "requests": len(done), "tokens": tokens, "seconds": round(wall, 3),
          "tokens_per_s": round(tokens / wall, 2), "prefill_share": round(prefill_s / wall, 3),
          "decode_tokens_per_s": round(tokens / max(wall - prefill_s, 1e-9), 2), "requests_per_s": round(len(done) / wall, 3),
          "latency_p50_s": round(_percentile(lat, 50), 3), "latency_p99_s": round(_percentile(lat, 99), 3),
          "ttft_p50_s": round(_percentile(ttft, 50), 3), "ttft_p99_s": round(_percentile(ttft, 99), 3),
          "mat": round(float(np.mean([r["mat"] for r in done])), 3)}
    sources = draft_sources(done)  # TR modes: draft tokens per source over the level's requests
    if sources is not None:
        row["draft_sources"] = sources
    return row


Run = tuple[list[dict], float, float]  # one run of a level: (finished requests, wall seconds, prefill seconds)


def _merged(mode: str, c: int, runs: list[Run]) -> dict:
    """A level's row over its runs: their requests together, their seconds summed; with more than one
    run, each run's tokens/s too (`runs_tokens_per_s`)."""
    row = _summary(mode, c, [d for done, _, _ in runs for d in done], sum(r[1] for r in runs), sum(r[2] for r in runs))
    if len(runs) > 1:
        row["runs_tokens_per_s"] = [round(sum(d["tokens"] for d in done) / wall, 2) for done, wall, _ in runs]
    return row


def _copied(matrix):
    """A copy of an adjacency matrix (rows, confidences, version)."""
    from ..engine.tr.matrix import AdjacencyMatrix

    return AdjacencyMatrix(matrix.spec, matrix.rows.device, rows=matrix.rows.clone(), version=matrix.version,
                           probs=matrix.probs.clone())


def _engine(decoder, mode: str, config: ConcurrencyConfig, engines: dict):
    """`mode`'s engine, kept for the whole bench as a worker keeps one (an engine per run faulted in fresh KV
    and cache memory, ~2.6 ms/MB: up to a tenth of a run at eight requests, more in some runs than others);
    its prefix cache starts each run empty (every run sends the same prompts), its blocks kept."""
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.tuning.cost import engine_cost

    if mode not in engines:
        engines[mode] = BatchEngine(decoder, EngineConfig(max_batch=max(config.levels), prefill_chunk=config.prefill_chunk,
                                                          batch_aware=mode != "tr-full"), engine_cost(decoder, measure=True))
    engine = engines[mode]
    if engine.prefix is not None:
        engine.prefix.clear(release=False)
    return engine


def _batched(decoder, mode: str, c: int, config: ConcurrencyConfig, convs, matrices: dict, engines: dict) -> Run:
    from ..engine import GenerationRequest
    from ..engine.results import GenerationResult

    engine = _engine(decoder, mode, config, engines)
    feed = itertools.cycle(convs)
    total, started, done = config.requests(c), 0, []

    def send(turn: Turn) -> None:
        nonlocal started
        tenant, messages, _ = turn
        t0, first = time.perf_counter(), []
        request = GenerationRequest(messages=messages, max_new_tokens=config.max_new_tokens,
                                    mode="ar" if mode == "ar" else "tr")

        def emit(item) -> None:
            now = time.perf_counter()
            if not first:
                first.append(now - t0)
            if isinstance(item, GenerationResult):
                done.append(_done(item.stats, len(item.ids), now - t0, first[0], sources=mode != "ar"))
                if started < total:
                    send(_follow(feed, turn, item.text))

        started += 1
        engine.submit(decoder.prepare(request), emit, matrix=matrices[tenant], tenant=tenant)

    t0 = time.perf_counter()
    for _ in range(min(c, total)):
        send(_opening(feed))
    with engine.stepping(), _prefill_timed(engine.runner) as chunk_s:
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    return done, time.perf_counter() - t0, sum(chunk_s)


def _server_batched(server, tokenizer, c: int, config: ConcurrencyConfig, convs) -> Run:
    """c closed-loop clients on a llama-server (its slots batch them): the conversations, budget and
    chat-templated prompt ids `_batched` sends trserve's engine. No prefill split: 0 prefill seconds."""
    import threading

    from .llama_server import tokens_per_forward

    feed, lock, total, done = itertools.cycle(convs), threading.Lock(), config.requests(c), []
    started = min(c, total)

    def client(turn: Turn | None) -> None:
        nonlocal started
        while turn is not None:
            ids = tokenizer.apply_chat_template(turn[1], add_generation_prompt=True, return_dict=False)
            t0 = time.perf_counter()
            out, ttft, timings = server.stream(list(ids), config.max_new_tokens)
            latency, text = time.perf_counter() - t0, tokenizer.decode(out, skip_special_tokens=True)
            with lock:
                done.append({"tokens": len(out), "latency": latency, "ttft": ttft,
                             "mat": tokens_per_forward(timings, len(out))})
                turn, started = (_follow(feed, turn, text), started + 1) if started < total else (None, started)

    openings = [_opening(feed) for _ in range(started)]
    t0 = time.perf_counter()
    clients = [threading.Thread(target=client, args=(turn,), daemon=True) for turn in openings]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    return done, time.perf_counter() - t0, 0.0


@contextmanager
def _prefill_timed(runner):
    """While open, `runner.prefill` appends each chunk's seconds to the list it yields."""
    prefill, chunk_s = runner.prefill, []

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return prefill(*args, **kwargs)
        finally:
            chunk_s.append(time.perf_counter() - t)

    runner.prefill = timed
    try:
        yield chunk_s
    finally:
        runner.prefill = prefill


def _serial(decoder, c: int, config: ConcurrencyConfig, convs, matrices: dict) -> Run:
    """c clients in front of a one-at-a-time server: each request waits for those ahead of it."""
    feed = itertools.cycle(convs)
    total, done, prefill_s = config.requests(c), [], 0.0
    queue: deque[tuple[float, Turn]] = deque()
    t0 = time.perf_counter()
    for _ in range(min(c, total)):
        queue.append((time.perf_counter(), _opening(feed)))
    started = len(queue)
    while queue:
        sent, turn = queue.popleft()
        tenant, messages, _ = turn
        begin = time.perf_counter()
        r = decoder.generate(messages=messages, max_new_tokens=config.max_new_tokens, matrix=matrices[tenant])
        now = time.perf_counter()
        done.append(_done(r.stats, len(r.ids), now - sent, begin - sent + r.stats.prefill_s,
                          sources=r.stats.draft_mode != "none"))
        prefill_s += r.stats.prefill_s
        if started < total:
            queue.append((now, _follow(feed, turn, r.text)))
            started += 1
    return done, time.perf_counter() - t0, prefill_s


def fairness(decoder, config: ConcurrencyConfig, prompts, long_tokens: int = 2000) -> dict:
    """While 4 requests decode, a request with a `long_tokens` prompt arrives: the running requests'
    p99 inter-token gap before vs while it is prefilled, and the cost of one prefill chunk."""
    from ..engine import GenerationRequest
    from ..engine.engine import BatchEngine, EngineConfig
    from ..engine.tuning.cost import engine_cost
    from ..engine.results import StepChunk

    engine = BatchEngine(decoder, EngineConfig(max_batch=8, prefill_chunk=config.prefill_chunk), engine_cost(decoder, measure=True))
    stamps: list[list[float]] = [[] for _ in range(4)]
    for i in range(4):
        def emit(item, mine=stamps[i]) -> None:
            if isinstance(item, StepChunk):
                mine.append(time.perf_counter())
        request = GenerationRequest(messages=prompts[i], max_new_tokens=200, ignore_eos=True)
        engine.submit(decoder.prepare(request), emit, matrix=decoder.new_matrix())
    text = " ".join(m[0]["content"] for m in prompts)
    ids = decoder.tokenizer(text, add_special_tokens=False)["input_ids"][:long_tokens]
    with engine.stepping():
        while min(map(len, stamps)) < 30:
            engine.step()
        with _prefill_timed(engine.runner) as chunk_s:
            engine.submit(decoder.prepare(GenerationRequest(input_ids=ids, max_new_tokens=8)), lambda item: None,
                          matrix=decoder.new_matrix())
            start = time.perf_counter()
            while engine.waiting or engine.prefilling:
                engine.step()
            end = time.perf_counter()
        for _ in range(20):
            engine.step()
    before = [b - a for s in stamps for a, b in zip(s, s[1:]) if b < start]
    during = [b - a for s in stamps for a, b in zip(s, s[1:]) if a >= start and b <= end]
    return {"prompt_tokens": len(ids), "prefill_chunk": config.prefill_chunk, "chunks": len(chunk_s),
            "chunk_s_mean": round(float(np.mean(chunk_s)), 4), "chunk_s_max": round(max(chunk_s), 4),
            "gap_p99_before_s": round(_percentile(before, 99), 4), "gap_p99_during_s": round(_percentile(during, 99), 4),
            "gap_p50_before_s": round(_percentile(before, 50), 4), "gap_p50_during_s": round(_percentile(during, 50), 4)}


def _servers(config: ConcurrencyConfig) -> dict:
    """A llama-server per peer mode asked for, on --model's GGUF or the bundled one (a process each: no
    mode reuses another's prompt cache; as many slots as the highest level)."""
    if not set(SERVERS) & set(config.modes):
        return {}
    from .llama_server import start_mode
    from .runner import _bundled_gguf

    threads, gguf = config.threads or torch.get_num_threads(), config.model or _bundled_gguf()
    return {m: start_mode(m, gguf, threads, parallel=max(config.levels)) for m in config.modes if m in SERVERS}


def _levels(config: ConcurrencyConfig, decoder, convs, matrices: dict, engines: dict, servers: dict) -> list[dict]:
    """Every level's rows, the modes taking turns within each run of a level."""
    from ..engine.tr.history import SuffixHistory
    from ..engine.tr.source import LocalDraftSource

    rows = []
    for c in config.levels:
        runs: dict[str, list[Run]] = {mode: [] for mode in config.modes}
        start = {mode: {t: s.matrix for t, s in matrices[mode].items()} for mode in config.modes}
        for r in range(config.repeats):
            for mode in config.modes:
                # every run sends the same prompts again: a tenant's history of the last run would hold
                # their very answers (a cache, not drafting), so each run starts a fresh one; matrices stay
                # hot across levels, and each repeat of a level starts from the level's (a copy of them)
                matrices[mode] = {t: LocalDraftSource(_copied(m) if r < config.repeats - 1 else m, SuffixHistory())
                                  for t, m in start[mode].items()}
                run = (_serial(decoder, c, config, convs, matrices[mode]) if mode == "serial"
                       else _server_batched(servers[mode], decoder.tokenizer, c, config, convs) if mode in servers
                       else _batched(decoder, mode, c, config, convs, matrices[mode], engines))
                runs[mode].append(run)
                log.info("%s", _summary(mode, c, *run))
        rows += [_merged(mode, c, runs[mode]) for mode in config.modes]
    rows.sort(key=lambda r: config.modes.index(r["mode"]))  # stable: levels ascending within a mode
    return rows


def run_concurrency(config: ConcurrencyConfig) -> dict:
    from ..engine import Decoder, DecoderConfig, ModelConfig

    if config.threads:
        torch.set_num_threads(config.threads)
    model = ModelConfig(**({"source": config.model} if config.model else {}), kernels=config.kernels,
                        threads=config.threads, arithmetic=config.arithmetic)
    decoder = Decoder(DecoderConfig(model=model))
    prompts, convs = _prompts(config.prompts), conversations(config.prompts, config)
    decoder.generate(messages=prompts[0], max_new_tokens=16)  # warm-up
    # each mode's matrices stay hot per tenant across levels; the modes take turns at each level, so a
    # shared host's slow minutes fall on all of them alike (run one after the other, a mode that ran in
    # a slow spell looked up to 20% slower than one that did not)
    tenants = list(dict.fromkeys(tenant for tenant, _ in convs))
    matrices = {mode: {t: decoder.new_tenant() for t in tenants} for mode in config.modes}  # matrix + history
    servers = _servers(config)
    try:
        rows = _levels(config, decoder, convs, matrices, {}, servers)
    finally:
        for server in servers.values():
            server.close()
    fair = fairness(decoder, config, prompts)
    log.info("fairness: %s", fair)
    loaded = decoder.loaded
    report = {"config": asdict(config), "host": host_facts(), "kernels": loaded.kernels, "isa": loaded.isa,
              "arithmetic": loaded.arithmetic, "rows": rows, "fairness": fair, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = Path(config.json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    table = f"{host_line(report['host'])}; kernels {loaded.isa}, {loaded.arithmetic}\n" + format_table(rows) + (
        f"\nfairness: a {fair['prompt_tokens']}-token prompt arrives while 4 requests decode: their p99 "
        f"inter-token gap {fair['gap_p99_before_s'] * 1e3:.0f} ms before, {fair['gap_p99_during_s'] * 1e3:.0f} ms "
        f"during its prefill ({fair['chunks']} chunks of {fair['prefill_chunk']}, "
        f"{fair['chunk_s_mean'] * 1e3:.0f} ms each, max {fair['chunk_s_max'] * 1e3:.0f} ms)") + format_sources(rows) + format_runs(rows)
    path.with_suffix(".txt").write_text(table + "\n")
    print(table)
    plot(rows, path.with_suffix(".png"))
    return report
