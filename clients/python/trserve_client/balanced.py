"""`BalancedClient`: Generate calls spread over several workers (round robin), a call retried on
another worker when one is down.

    with BalancedClient(["127.0.0.1:50051", "127.0.0.1:50061"], timeout=60) as client:
        reply = client.generate(messages=[{"role": "user", "content": "Hi"}], tenant="acme", max_new_tokens=32)

A call that fails with UNAVAILABLE (worker dead, restarting or unreachable) or RESOURCE_EXHAUSTED
(its queue is full) is retried on the next worker, each worker at most once per call, within the
call's one overall deadline; the failing worker is skipped by later calls for `down_for_s`. Generate
is safe to repeat: its output is the model's greedy output, and a repeat only recycles the model's
own top-k rows into the tenant's matrix once more. A stream is retried only before its first chunk.
Any other status is the caller's to handle and is raised at once (as the typed errors of errors.py).

`affinity="tenant"` sends each tenant's calls to the same worker while it is up (rendezvous hashing:
the worker with the highest hash of (tenant, address); adding or removing a worker moves only the
tenants it wins or held), and on failure to that tenant's next worker. A worker keeps the keys and
values of its finished requests per tenant, so a chat's next turn or an agent loop's next call then
prefills only what it adds; round robin spreads one tenant's turns over all workers, each
prefilling the whole conversation again.

In Kubernetes, the headless worker Service gives the same spread from one channel:
`Client("dns:///trserve-worker:50051")` (the service config's round_robin).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from trserve_client._proto.trserve.v1 import generate_pb2_grpc
from trserve_client.client import Chunk, Reply, bearer_metadata, build_request, credentials, is_loopback, open_channel
from trserve_client.errors import typed

RETRY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
AFFINITIES = ("none", "tenant")


def rendezvous(key: str, addrs: Sequence[str]) -> list[int]:
    """Indices of `addrs` by descending hash of (key, address): the same order in every process, and
    removing an address leaves the order of the others as it was. Example: a tenant whose first
    worker dies goes to its second one, and every other tenant stays where it was."""
    def score(addr: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{addr}".encode(), digest_size=8).digest()

    return sorted(range(len(addrs)), key=lambda i: score(addrs[i]), reverse=True)


def check_plaintext_tokens(addrs: Sequence[str], tls_ca_file: str | None, has_tokens: bool, allow: bool) -> None:
    """ValueError when tenant bearer tokens would travel without TLS to another machine, unless allowed."""
    far = [a for a in addrs if not is_loopback(a)]
    if has_tokens and tls_ca_file is None and not allow and far:
        raise ValueError(f"refusing to send tenant tokens without TLS to {far[0]}: pass a TLS CA file (--tls-ca), "
                         "or allow plaintext explicitly (--allow-plaintext-token) on a trusted network")


@dataclass(frozen=True)
class Served:
    """A reply and how it was obtained."""

    reply: Reply
    addr: str  # the worker that answered
    retried_after: tuple[str, ...] = ()  # status codes of the workers tried before it, in order

    @property
    def attempts(self) -> int:
        return 1 + len(self.retried_after)


class BalancedClient:
    """Round robin over `addrs` with retry on another worker (see the module docstring). Thread-safe.

    `tokens`: tenant -> bearer token, for workers started with --tenant-tokens. `tls_ca_file`: PEM
    CA to trust, for workers serving TLS; tokens are never sent without it to a non-loopback address
    unless `allow_plaintext_token`. `timeout`: the default deadline of a call, retries included.
    """

    def __init__(self, addrs: Sequence[str], *, timeout: float | None = None, tokens: Mapping[str, str] | None = None,
                 tls_ca_file: str | None = None, down_for_s: float = 2.0,
                 retry_codes: frozenset[grpc.StatusCode] = RETRY_CODES, allow_plaintext_token: bool = False,
                 affinity: str = "none") -> None:
        if not addrs:
            raise ValueError("give at least one worker address (HOST:PORT)")
        if affinity not in AFFINITIES:
            raise ValueError(f"affinity must be one of {', '.join(AFFINITIES)}, got {affinity!r}")
        self.affinity = affinity
        check_plaintext_tokens(addrs, tls_ca_file, bool(tokens), allow_plaintext_token)
        self.addrs = list(addrs)
        self.timeout, self.down_for_s, self.retry_codes = timeout, down_for_s, retry_codes
        self._tokens = dict(tokens or {})
        creds = credentials(tls_ca_file)
        self._channels = [open_channel(addr, creds) for addr in self.addrs]  # no service config: retries are ours
        self._stubs = [generate_pb2_grpc.GenerateStub(c) for c in self._channels]
        self._next = itertools.count()
        self._down_until = [0.0] * len(self.addrs)
        self._lock = threading.Lock()

    # -- calls -------------------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Reply:
        """Decode to the end on one of the workers; keyword arguments as `build_request`."""
        return self.generate_served(prompt, timeout=timeout, **kwargs).reply

    def generate_served(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Served:
        """As `generate`, also saying which worker answered after how many attempts."""
        request = build_request(prompt, **kwargs)
        metadata = self._metadata(request.tenant)
        reply, addr, failed = self._with_retries(
            timeout, lambda stub, left: stub.Generate(request, timeout=left, metadata=metadata), request.tenant)
        return Served(Reply.of(reply), addr, failed)

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Iterator[Chunk]:
        """Per-step chunks from one worker; moves to another only while no chunk has arrived yet."""
        request = build_request(prompt, **kwargs)
        metadata = self._metadata(request.tenant)

        def first(stub: generate_pb2_grpc.GenerateStub, left: float | None):
            call = stub.GenerateStream(request, timeout=left, metadata=metadata)
            return call, next(call, None)

        (call, head), _, _ = self._with_retries(timeout, first, request.tenant)
        if head is not None:
            yield Chunk.of(head)
            try:
                for item in call:
                    yield Chunk.of(item)
            except grpc.RpcError as e:
                raise typed(e) from None

    # -- round robin and retries -------------------------------------------------------------
    def _metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._tokens.get(tenant or "default"))

    def _order(self, tenant: str = "") -> list[int]:
        """Every worker once: from the next in turn (with tenant affinity: by the tenant's rendezvous
        order); those marked down go last."""
        n = len(self.addrs)
        if self.affinity == "tenant":
            order = rendezvous(tenant or "default", self.addrs)
        else:
            start = next(self._next) % n
            order = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        with self._lock:
            return sorted(order, key=lambda i: self._down_until[i] > now)  # stable: the order among the up

    def _with_retries(self, timeout: float | None, call: Callable, tenant: str = "") -> tuple[object, str, tuple[str, ...]]:
        """(call(stub, seconds left), the worker's address, codes of the failed tries before it),
        trying each worker at most once."""
        timeout = timeout if timeout is not None else self.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        error: grpc.RpcError | None = None
        failed: list[str] = []
        for i in self._order(tenant):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                return call(self._stubs[i], left), self.addrs[i], tuple(failed)
            except grpc.RpcError as exc:
                if exc.code() not in self.retry_codes:
                    raise typed(exc) from None
                error = exc
                failed.append(exc.code().name)
                with self._lock:
                    self._down_until[i] = time.monotonic() + self.down_for_s
        if error is None:  # the deadline passed before any attempt
            raise TimeoutError(f"no attempt fitted in the deadline of {timeout} s")
        raise typed(error) from None

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> BalancedClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
