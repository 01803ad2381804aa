"""A bounded load run: `concurrency` client threads send `requests` Generate calls, round robin over
the workers through trserve_client's BalancedClient (retry on another worker when one is down), request i for
tenant `{prefix}-{i % tenants}` with prompt `PROMPTS[i % len(PROMPTS)]`.

Loopback only: every address must resolve to 127.0.0.0/8 or ::1 (this is a test tool, not a way
to load someone else's server). The run is bounded in count (`requests`) and time (`max_duration_s`:
no request is started after it).
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from trserve_client import BalancedClient
from ..common.security import load_tokens_by_tenant
from .prompts import PROMPTS
from .report import LoadReport, RequestRecord

MAX_REQUESTS, MAX_CONCURRENCY = 10_000, 64


def is_loopback(addr: str) -> bool:
    """Whether HOST:PORT resolves to loopback addresses only. Example: "localhost:50051" -> True."""
    host = addr.rpartition(":")[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


@dataclass(frozen=True)
class LoadConfig:
    addrs: tuple[str, ...]  # worker HOST:PORTs, loopback only
    concurrency: int = 4  # client threads, each with one call in flight
    requests: int = 32  # calls in the whole run
    tenants: int = 4  # distinct tenants, round robin over requests
    tenant_prefix: str = "load"
    max_new_tokens: int = 32
    timeout_s: float = 120.0  # one call's deadline, retries on other workers included
    max_duration_s: float = 600.0  # no call starts after this
    tokens_file: str | None = None  # tenant token JSON file, for workers that require tokens
    tls_ca_file: str | None = None  # PEM CA, for workers serving TLS

    def __post_init__(self) -> None:
        if not self.addrs:
            raise ValueError("give at least one worker address, e.g. --addrs 127.0.0.1:50051,127.0.0.1:50061")
        remote = [a for a in self.addrs if not is_loopback(a)]
        if remote:
            raise ValueError(f"load is for loopback only (127.0.0.0/8, ::1, localhost); refusing {remote}")
        for name, value, top in (("concurrency", self.concurrency, MAX_CONCURRENCY),
                                 ("requests", self.requests, MAX_REQUESTS), ("tenants", self.tenants, 1000),
                                 ("max_new_tokens", self.max_new_tokens, 4096)):
            if not 1 <= value <= top:
                raise ValueError(f"{name} must be in 1..{top}, got {value}")
        if not 0 < self.timeout_s <= 3600 or not 0 < self.max_duration_s <= 3600:
            raise ValueError("timeout_s and max_duration_s must be in (0, 3600] seconds")

    def tenant(self, i: int) -> str:
        return f"{self.tenant_prefix}-{i % self.tenants}"


def one_request(client: BalancedClient, config: LoadConfig, i: int) -> RequestRecord:
    tenant, prompt = config.tenant(i), i % len(PROMPTS)
    t0 = time.perf_counter()
    try:
        served = client.generate_served(messages=[{"role": "user", "content": PROMPTS[prompt]}], tenant=tenant,
                                        max_new_tokens=config.max_new_tokens)
    except grpc.RpcError as exc:
        return RequestRecord(i, tenant, prompt, exc.code().name, time.perf_counter() - t0, None)
    except TimeoutError:
        return RequestRecord(i, tenant, prompt, "DEADLINE_EXCEEDED", time.perf_counter() - t0, None)
    s = served.reply.stats
    return RequestRecord(i, tenant, prompt, "OK", time.perf_counter() - t0, served.addr, served.retried_after,
                         s.generated_tokens, s.mean_accepted_tokens, s.draft_mode, served.reply.text)


def run_load(config: LoadConfig, progress: bool = False,
             on_done: Callable[[RequestRecord, int], None] | None = None) -> LoadReport:
    """Run the load; `on_done(record, finished_so_far)` is called from the client threads (tests
    use it to stage a crash mid-run)."""
    tokens = load_tokens_by_tenant(config.tokens_file) if config.tokens_file else None
    records: list[RequestRecord] = []
    lock = threading.Lock()
    failed = 0
    numbers = itertools.count()
    bar = tqdm(total=config.requests, unit="req", disable=not progress, dynamic_ncols=True)
    stop_at = time.monotonic() + config.max_duration_s
    stopped_early = threading.Event()

    with BalancedClient(config.addrs, timeout=config.timeout_s, tokens=tokens,
                        tls_ca_file=config.tls_ca_file) as client:
        def loop() -> None:
            while (i := next(numbers)) < config.requests:
                if time.monotonic() > stop_at:
                    stopped_early.set()
                    return
                record = one_request(client, config, i)
                nonlocal failed
                with lock:
                    records.append(record)
                    failed += record.code != "OK"
                    done = len(records)
                    bar.update(1)
                    bar.set_postfix(failed=failed, refresh=False)
                if on_done is not None:
                    on_done(record, done)

        threads = [threading.Thread(target=loop, name=f"load-{n}") for n in range(config.concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    bar.close()
    records.sort(key=lambda r: r.index)
    return LoadReport(records, wall, list(config.addrs), config.concurrency, stopped_early.is_set())
