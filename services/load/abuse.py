"""`trserve load --abuse`: good and bad requests from several tenants against one running worker,
for a bounded time, loopback only. Reports the status codes each kind of bad request got, every
unexpected status (0 expected), whether the worker still serves afterwards, and the good requests'
p99 latency during the abuse against a short good-only baseline run before it.

Bad kinds (each with the status codes a hardened worker answers; RESOURCE_EXHAUSTED "busy" is
allowed for every kind, since a loaded worker may refuse any call before looking at it):
oversize body, too many messages, bad temperature, too many / too long stop strings, invalid ids,
foreign domain (a domain naming another tenant; needs tenant tokens), cancel mid-stream, a reader
that stops reading, a deadline too short to decode anything.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from trserve_client import build_request

from ..common.security import bearer_metadata, client_channel, load_tokens_by_tenant
from .prompts import PROMPTS
from .report import percentile
from .runner import is_loopback
from ...v1 import generate_pb2 as pb
from ...v1 import generate_pb2_grpc

C = grpc.StatusCode
BUSY = C.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class AbuseConfig:
    addr: str  # one worker, loopback only
    duration_s: float = 60.0  # the abuse run
    baseline_s: float = 10.0  # the good-only run before it
    good_clients: int = 2
    bad_clients: int = 3
    tenants: int = 3
    max_new_tokens: int = 16
    max_request_bytes: int = 1 << 20  # the worker's body limit (an oversize body exceeds it)
    call_timeout_s: float = 60.0
    tokens_file: str | None = None  # tenant token JSON file (workers with --tenant-tokens); enables "foreign domain"
    tls_ca_file: str | None = None

    def __post_init__(self) -> None:
        if not is_loopback(self.addr):
            raise ValueError(f"abuse runs are for loopback only (127.0.0.0/8, ::1, localhost); refusing {self.addr!r}")
        if not 0 < self.duration_s <= 3600 or not 0 <= self.baseline_s <= 600:
            raise ValueError("duration_s must be in (0, 3600] and baseline_s in [0, 600] seconds")
        for name, value, top in (("good_clients", self.good_clients, 16), ("bad_clients", self.bad_clients, 16),
                                 ("tenants", self.tenants, 100), ("max_new_tokens", self.max_new_tokens, 512)):
            if not 1 <= value <= top:
                raise ValueError(f"{name} must be in 1..{top}, got {value}")


class _Target:
    """The worker's stub, and each tenant's name and bearer metadata."""

    def __init__(self, config: AbuseConfig) -> None:
        self.config = config
        self.channel = client_channel(config.addr, config.tls_ca_file)
        self.stub = generate_pb2_grpc.GenerateStub(self.channel)
        if config.tokens_file:
            tokens = load_tokens_by_tenant(config.tokens_file)
            self.tenants = sorted(tokens)[: config.tenants]
            self.metadata = {t: bearer_metadata(tokens[t]) for t in self.tenants}
        else:
            self.tenants = [f"abuse-{i}" for i in range(config.tenants)]
            self.metadata = {t: () for t in self.tenants}

    def good_request(self, i: int) -> tuple[pb.GenerateRequest, tuple]:
        tenant = self.tenants[i % len(self.tenants)]
        req = build_request(messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tenant=tenant,
                            max_new_tokens=self.config.max_new_tokens)
        return req, self.metadata[tenant]


def _unary(target: _Target, req: pb.GenerateRequest, metadata, timeout: float | None = None) -> C:
    try:
        target.stub.Generate(req, timeout=timeout or target.config.call_timeout_s, metadata=metadata)
        return C.OK
    except grpc.RpcError as exc:
        return exc.code()


def _bad_ids(vocab: int):
    return lambda i: build_request(token_ids=[1, -5 if i % 2 else vocab + 7])


def _simple(make: Callable[[int], pb.GenerateRequest]) -> Callable[[_Target, int], C]:
    """A kind that sends one unary request built by `make(i)`, as the i-th call's tenant."""
    def run(t: _Target, i: int) -> C:
        tenant = t.tenants[i % len(t.tenants)]
        req = make(i)
        req.tenant = tenant
        return _unary(t, req, t.metadata[tenant])
    return run


def _many_messages(i: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 5000))
    req.messages.messages.add(role="user", content="hi")
    return req


def _cancel_mid_stream(t: _Target, i: int) -> C:
    req, metadata = t.good_request(i)
    req.max_new_tokens = 128
    call = t.stub.GenerateStream(req, timeout=t.config.call_timeout_s, metadata=metadata)
    try:
        for n, _ in enumerate(call):
            if n == 1:
                call.cancel()
        return C.OK
    except grpc.RpcError as exc:
        return exc.code()


def _stalled_reader(t: _Target, i: int) -> C:
    req, metadata = t.good_request(i)
    req.max_new_tokens = 256
    call = t.stub.GenerateStream(req, timeout=t.config.call_timeout_s, metadata=metadata)
    try:
        next(call)
        time.sleep(3.0)  # reads nothing more for a while, then goes away
        call.cancel()
        for _ in call:
            pass
        return C.OK
    except grpc.RpcError as exc:
        return exc.code()


def _short_deadline(t: _Target, i: int) -> C:
    req, metadata = t.good_request(i)
    return _unary(t, req, metadata, timeout=0.005)


def _foreign(t: _Target, i: int) -> C:
    own, other = t.tenants[i % len(t.tenants)], t.tenants[(i + 1) % len(t.tenants)]
    req = build_request(messages=[{"role": "user", "content": "hi"}], tenant=own, domain=other, max_new_tokens=2)
    return _unary(t, req, t.metadata[own])


TEMPERATURES = (1e-39, -1.0, math.nan, math.inf, 1e-3)


def _kinds(target: _Target, vocab: int) -> dict[str, tuple[Callable[[_Target, int], C], frozenset]]:
    """kind -> (run it once (the i-th time), the codes a hardened worker may answer)."""
    cfg = target.config
    hi = [{"role": "user", "content": "hi"}]
    kinds = {
        "oversize body": (_simple(lambda i: build_request("x" * (cfg.max_request_bytes + 1024))), {BUSY}),
        "too many messages": (_simple(_many_messages), {C.INVALID_ARGUMENT}),
        "bad temperature": (_simple(lambda i: build_request(messages=hi, temperature=TEMPERATURES[i % 5])),
                            {C.INVALID_ARGUMENT}),
        "too many stop strings": (_simple(lambda i: build_request(messages=hi, stop=[f"s{n}" for n in range(100)])),
                                  {C.INVALID_ARGUMENT}),
        "too long stop string": (_simple(lambda i: build_request(messages=hi, stop=["y" * 10_000])),
                                 {C.INVALID_ARGUMENT}),
        "too many stop ids": (_simple(lambda i: build_request(messages=hi, stop_token_ids=list(range(1000)))),
                              {C.INVALID_ARGUMENT}),
        "invalid ids": (_simple(_bad_ids(vocab)), {C.INVALID_ARGUMENT}),
        "cancel mid-stream": (_cancel_mid_stream, {C.CANCELLED, C.OK}),
        "stalled reader": (_stalled_reader, {C.CANCELLED, C.OK}),
        "deadline too short": (_short_deadline, {C.DEADLINE_EXCEEDED}),
    }
    if cfg.tokens_file and len(target.tenants) >= 2:
        kinds["foreign domain"] = (_foreign, {C.PERMISSION_DENIED})
    return {k: (run, frozenset(codes) | {BUSY}) for k, (run, codes) in kinds.items()}


@dataclass
class AbuseReport:
    config: AbuseConfig
    baseline: list[float]  # good latencies, no abuse
    good: list[float]  # good latencies during the abuse
    good_codes: Counter  # final codes of good requests during the abuse
    good_retries: int  # RESOURCE_EXHAUSTED answers a good client waited out
    bad: dict[str, Counter]  # kind -> codes received
    unexpected: list[dict]  # {kind, code} not in the kind's expected codes (good requests: anything but OK)
    serving_after: bool
    wall_s: float
    skipped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unexpected and self.serving_after

    def to_json(self) -> dict:
        def lat(values: list[float]) -> dict:
            v = sorted(values)
            return {"n": len(v), "p50": round(percentile(v, 50), 3), "p99": round(percentile(v, 99), 3)}
        tried = sum(sum(c.values()) for c in self.bad.values()) + sum(self.good_codes.values()) + len(self.baseline)
        return {
            "worker": self.config.addr, "duration_s": round(self.wall_s, 1), "requests_tried": tried,
            "baseline_good_latency_s": lat(self.baseline), "good_latency_s": lat(self.good),
            "good_codes": dict(self.good_codes), "good_busy_retries": self.good_retries,
            "bad_by_kind": {k: dict(c) for k, c in sorted(self.bad.items())},
            "unexpected": self.unexpected, "unexpected_count": len(self.unexpected),
            "serving_after": self.serving_after, "skipped_kinds": self.skipped, "ok": self.ok,
        }

    def format(self) -> str:
        s = self.to_json()
        b, g = s["baseline_good_latency_s"], s["good_latency_s"]
        lines = [
            f"worker       {s['worker']}, {s['duration_s']:.0f} s of abuse, {s['requests_tried']} requests tried",
            f"good         baseline p50 {b['p50']:.2f} s p99 {b['p99']:.2f} s ({b['n']}); under abuse p50 "
            f"{g['p50']:.2f} s p99 {g['p99']:.2f} s ({g['n']}); codes {s['good_codes']}, "
            f"{s['good_busy_retries']} busy retries",
            f"{'bad kind':<24}{'tried':>6}  codes",
        ]
        for kind, codes in s["bad_by_kind"].items():
            lines.append(f"{kind:<24}{sum(codes.values()):>6}  " + ", ".join(f"{c} {n}" for c, n in sorted(codes.items())))
        lines += [f"unexpected   {s['unexpected_count']}" + (f": {s['unexpected'][:5]}" if s["unexpected"] else ""),
                  f"serving after {'yes' if s['serving_after'] else 'NO'}"
                  + (f"; skipped kinds {s['skipped_kinds']} (need --tokens)" if s["skipped_kinds"] else "")]
        return "\n".join(lines)


def _good_loop(target: _Target, stop_at: float, latencies: list[float], codes: Counter, unexpected: list,
               retries: list[int], counter: itertools.count, lock: threading.Lock) -> None:
    while time.monotonic() < stop_at:
        i = next(counter)
        req, metadata = target.good_request(i)
        t0 = time.perf_counter()
        for _ in range(50):  # a busy worker says when to come back: wait that out (bounded)
            try:
                target.stub.Generate(req, timeout=target.config.call_timeout_s, metadata=metadata)
                code = C.OK
                break
            except grpc.RpcError as exc:
                code = exc.code()
                if code != BUSY:
                    break
                hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms", "100")
                with lock:
                    retries[0] += 1
                time.sleep(min(2.0, int(hint) / 1000))
        with lock:
            codes[code.name] += 1
            if code == C.OK:
                latencies.append(time.perf_counter() - t0)
            else:
                unexpected.append({"kind": "good", "code": code.name})


def _bad_loop(target: _Target, kinds: dict, stop_at: float, counter, bad: dict, unexpected: list,
              lock: threading.Lock) -> None:
    """One bad client: the kinds in turn until `stop_at`, each answer counted, the unexpected noted."""
    names = list(kinds)
    while time.monotonic() < stop_at:
        i = next(counter)
        kind = names[i % len(names)]
        run, expected = kinds[kind]
        try:
            code = run(target, i)
        except Exception as exc:  # noqa: BLE001 - a client-side crash is a finding too
            with lock:
                unexpected.append({"kind": kind, "code": f"client error {type(exc).__name__}"})
            continue
        with lock:
            bad[kind][code.name] += 1
            if code not in expected:
                unexpected.append({"kind": kind, "code": code.name})


def run_abuse(config: AbuseConfig) -> AbuseReport:
    target = _Target(config)
    lock = threading.Lock()
    try:
        vocab = target.stub.ModelInfo(pb.ModelInfoRequest(), timeout=30,
                                      metadata=target.metadata[target.tenants[0]]).vocab_size
        kinds = _kinds(target, vocab)
        counter = itertools.count()

        def good_phase(seconds: float, latencies, codes, unexpected, retries) -> list[threading.Thread]:
            stop_at = time.monotonic() + seconds
            return [threading.Thread(target=_good_loop, args=(target, stop_at, latencies, codes, unexpected, retries,
                                                              counter, lock), name=f"abuse-good-{n}")
                    for n in range(config.good_clients)]

        baseline: list[float] = []
        threads = good_phase(config.baseline_s, baseline, Counter(), [], [0]) if config.baseline_s else []
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        good: list[float] = []
        good_codes: Counter = Counter()
        unexpected: list[dict] = []
        retries = [0]
        bad: dict[str, Counter] = defaultdict(Counter)
        bad_counter = itertools.count()
        t0 = time.monotonic()
        stop_at = t0 + config.duration_s

        threads = good_phase(config.duration_s, good, good_codes, unexpected, retries)
        threads += [threading.Thread(target=_bad_loop, args=(target, kinds, stop_at, bad_counter, bad, unexpected, lock),
                                     name=f"abuse-bad-{n}") for n in range(config.bad_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        req, metadata = target.good_request(0)
        serving = _unary(target, req, metadata) == C.OK
    finally:
        target.channel.close()
    skipped = [] if "foreign domain" in kinds else ["foreign domain"]
    return AbuseReport(config, baseline, good, good_codes, retries[0], dict(bad), unexpected, serving, wall, skipped)
