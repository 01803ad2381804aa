"""Authentication and TLS for trserve servers and clients.

- Tenant tokens (workers): callers send `authorization: Bearer <token>`; a token file maps each
  tenant to its token(s). A missing or unknown token is UNAUTHENTICATED; a valid token used for
  another tenant's request is PERMISSION_DENIED.
- Tenant tokens may grant domains: `{"tenant": {"tokens": [...], "domains": ["legal"]}}`; a
  request naming a domain its token does not grant is PERMISSION_DENIED (tokens without grants
  may name no domain).
- Matrix service: a worker secret for the data plane (DraftSession, Checkout, PushRows) and a
  separate admin secret for the admin RPCs; the worker secret does not authorise admin RPCs.
  Anything else is UNAUTHENTICATED (wrong or missing) or PERMISSION_DENIED (a worker secret on
  an admin RPC).
- A client refuses to send a secret in plaintext to a non-loopback address unless allowed.
- TLS: a server serves with a PEM certificate and key; a client trusts a PEM CA file.

Health and reflection stay open (orchestrators probe them without credentials). Secrets are read
from files, never from flags (flags show in `ps`), and never printed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from ...core.tenants import validate_tenant_id
from .logcontext import HEADER, REQUEST_ID, request_id

AUTH_HEADER = "authorization"
MIN_SECRET_CHARS = 16
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # method prefixes that need no credentials


def _read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {str(path)!r}: {exc.strerror or exc}") from None


def password_file(path: str | None, flag: str) -> str | None:
    """A password kept in a file (surrounding whitespace dropped); ValueError naming `flag`."""
    if path is None:
        return None
    try:
        password = _read_text(path, "password").strip()
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None
    if not password:
        raise ValueError(f"{flag}: the file {path!r} is empty")
    return password


def _check_secret(value: str, what: str) -> str:
    if len(value) < MIN_SECRET_CHARS or value != value.strip():
        raise ValueError(f"{what} must be at least {MIN_SECRET_CHARS} characters without surrounding spaces "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return value


def _digest(token: str) -> bytes:
    """Tokens are looked up by their hash: a dict lookup's timing then reveals nothing about a token."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class ServerTLS:
    """A server's TLS certificate chain and private key, PEM files."""

    cert_file: str
    key_file: str

    def __post_init__(self) -> None:
        for what, path in (("certificate", self.cert_file), ("private key", self.key_file)):
            if not Path(path).is_file():
                raise ValueError(f"TLS {what} file {path!r} does not exist")

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes()
        return grpc.ssl_server_credentials([(key, cert)])


def server_tls(cert_file: str | None, key_file: str | None) -> ServerTLS | None:
    """From --tls-cert/--tls-key flags: None without them; ValueError when only one is given."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("--tls-cert and --tls-key go together")
    return None if cert_file is None else ServerTLS(cert_file, key_file)


@dataclass(frozen=True)
class SharedSecret:
    """The secret workers present to the matrix service (repr hides it)."""

    value: str = field(repr=False)

    def __post_init__(self) -> None:
        _check_secret(self.value, "the shared secret")

    @classmethod
    def from_file(cls, path: str | Path) -> SharedSecret:
        return cls(_read_text(path, "shared secret").strip())

    def matches(self, token: str) -> bool:
        return hmac.compare_digest(_digest(token), _digest(self.value))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((AUTH_HEADER, f"Bearer {self.value}"),)


@dataclass(frozen=True)
class TenantTokens:
    """token hash -> tenant, from a JSON file {"tenant": "token" or ["token", ...] or
    {"tokens": [...], "domains": [...]}} (lists allow rotation; `domains` = the domains the
    tenant's requests may name)."""

    by_digest: dict[bytes, str] = field(repr=False)
    domains: dict[str, frozenset[str]] = field(default_factory=dict)  # tenant -> granted domains

    @classmethod
    def from_mapping(cls, mapping: object) -> TenantTokens:
        if not isinstance(mapping, dict) or not mapping:
            raise ValueError('the tenant token file must be a JSON object {"tenant": "token" or ["token", ...]}')
        by_digest: dict[bytes, str] = {}
        domains: dict[str, frozenset[str]] = {}
        for tenant, entry in mapping.items():
            validate_tenant_id(tenant)
            tokens, granted = _token_entry(tenant, entry)
            domains[tenant] = frozenset(validate_tenant_id(d, "domain") for d in granted)
            for token in tokens:
                if not isinstance(token, str):
                    raise ValueError(f"tenant {tenant!r}: tokens must be strings")
                digest = _digest(_check_secret(token, f"each token (tenant {tenant!r})"))
                if by_digest.setdefault(digest, tenant) != tenant:
                    raise ValueError(f"tenants {by_digest[digest]!r} and {tenant!r} share a token; give each its own")
        return cls(by_digest, domains)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTokens:
        try:
            mapping = json.loads(_read_text(path, "tenant token"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"the tenant token file {str(path)!r} is not JSON: {exc}") from None
        return cls.from_mapping(mapping)

    def tenant_of(self, token: str) -> str | None:
        return self.by_digest.get(_digest(token))

    def may_use_domain(self, tenant: str, domain: str) -> bool:
        return domain in self.domains.get(tenant, frozenset())


def _token_entry(tenant: str, entry: object) -> tuple[list, list]:
    """(tokens, granted domains) of one tenant's entry in a token file."""
    if isinstance(entry, str):
        return [entry], []
    if isinstance(entry, list):
        return entry, []
    if isinstance(entry, dict) and set(entry) <= {"tokens", "domains"} and "tokens" in entry:
        tokens, granted = entry["tokens"], entry.get("domains", [])
        tokens = [tokens] if isinstance(tokens, str) else tokens
        if not isinstance(tokens, list) or not isinstance(granted, list):
            raise ValueError(f"tenant {tenant!r}: 'tokens' and 'domains' must be lists")
        return tokens, granted
    raise ValueError(f'tenant {tenant!r}: use "token", ["token", ...] or {{"tokens": [...], "domains": [...]}}')


def load_tokens_by_tenant(path: str | Path) -> dict[str, str]:
    """Client side: tenant -> the first token listed for it in a tenant token file."""
    mapping = json.loads(_read_text(path, "tenant token"))
    TenantTokens.from_mapping(mapping)  # same validation as the server's
    return {tenant: _token_entry(tenant, entry)[0][0] for tenant, entry in mapping.items()}


# -- server interceptors ---------------------------------------------------------------------------------
def _bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer "):]
    return None


def _handler_like(handler: grpc.RpcMethodHandler, behavior: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as `handler`, running `behavior`."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


async def refuse_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """An interceptor's refusal, with the call's request id in its trailing metadata as every other error
    has it (the caller's plain `x-request-id`, else a new one; set as the log context too)."""
    given = next((value for key, value in context.invocation_metadata() or () if key == HEADER), None)
    rid = request_id(given if isinstance(given, str) else None)
    REQUEST_ID.set(rid)
    await context.abort(code, details, trailing_metadata=((HEADER, rid),))


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await refuse_call(context, code, details)

    return _handler_like(handler, refuse)


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Common shape: open services pass; others need a bearer credential that `authorize` accepts."""

    what = "credential"

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        token = _bearer(details.invocation_metadata)
        if token is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                             f"missing credentials: send metadata '{AUTH_HEADER}: Bearer <{self.what}>'")
        return self.authorize(token, handler, details.method)

    def authorize(self, token: str, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class SharedSecretAuth(_BearerAuth):
    """The matrix service. Worker methods (all but `admin_methods`) need `secret` (open when it is
    None) or the admin secret. Admin methods need `admin`; a worker secret there is refused with
    PERMISSION_DENIED, and so is every admin call when only a worker secret is configured. With
    no secret at all everything is open (the servicer still guards reserved tenants)."""

    what = "shared secret"

    def __init__(self, secret: SharedSecret | None, admin: SharedSecret | None = None,
                 admin_methods: frozenset[str] = frozenset()) -> None:
        self._secret, self._admin, self._admin_methods = secret, admin, admin_methods

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if self._secret is None and (self._admin is None or details.method not in self._admin_methods):
            return await continuation(details)  # nothing to check for this method
        return await super().intercept_service(continuation, details)

    def authorize(self, token: str, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        is_admin = self._admin is not None and self._admin.matches(token)
        is_worker = self._secret is not None and self._secret.matches(token)
        if method in self._admin_methods:
            if is_admin:
                return handler
            if self._admin is None:
                return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED,
                                 "admin RPCs need the admin secret and this service has none configured "
                                 "(--admin-secret-file); the worker secret does not authorise them")
            if is_worker:
                return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED,
                                 "admin RPCs need the admin secret; the worker secret does not authorise them")
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "wrong admin secret")
        if is_admin or is_worker:
            return handler
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "wrong shared secret")


def domain_refusal(tokens: TenantTokens | None, tenant: str, request: object) -> str | None:
    """Why `tenant` may not name the request's domain, or None when it may (or names none).
    Without tenant tokens (an open worker) any domain may be named: domains are operator-written
    matrices in their own namespace (core/tenants.py), never another tenant's."""
    has_field = getattr(request, "HasField", None)
    try:
        named = bool(has_field("domain")) if has_field is not None else bool(getattr(request, "domain", ""))
    except ValueError:  # a message without a `domain` field
        return None
    domain = getattr(request, "domain", "") if named else ""
    if tokens is None or not domain or tokens.may_use_domain(tenant, domain):
        return None
    return f"domain {domain!r} is not granted to tenant {tenant!r} (grant it in the tenant token file)"


class TenantAuth(_BearerAuth):
    """A worker: the token names a tenant; a request naming another tenant (an empty tenant
    means `default_tenant`) is refused. Requests without a tenant field need any valid token."""

    what = "tenant token"

    def __init__(self, tokens: TenantTokens, default_tenant: str) -> None:
        self._tokens, self._default = tokens, default_tenant

    def authorize(self, token: str, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        tenant = self._tokens.tenant_of(token)
        if tenant is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown tenant token")
        if handler.request_streaming:  # no such rpc in the Generate API; the request is not visible here
            return handler
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def check(request, context: grpc.aio.ServicerContext) -> None:
            asked = getattr(request, "tenant", None)
            if asked is not None and (asked or self._default) != tenant:
                await refuse_call(context, grpc.StatusCode.PERMISSION_DENIED,
                                  f"this token belongs to another tenant than {asked or self._default!r}")
            problem = domain_refusal(self._tokens, tenant, request)
            if problem is not None:
                await refuse_call(context, grpc.StatusCode.PERMISSION_DENIED, problem)

        if handler.response_streaming:
            async def stream(request, context: grpc.aio.ServicerContext):
                await check(request, context)
                async for item in inner(request, context):
                    yield item
            return _handler_like(handler, stream)

        async def unary(request, context: grpc.aio.ServicerContext):
            await check(request, context)
            return await inner(request, context)
        return _handler_like(handler, unary)


# -- client side -----------------------------------------------------------------------------------------
class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (a credential) to every call of a channel."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = list(metadata)

    def _with(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details, [*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def is_loopback(addr: str) -> bool:
    """Whether HOST:PORT names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext_secret(addr: str, tls_ca_file: str | None, secret: SharedSecret | None,
                           allow_plaintext_secret: bool) -> None:
    """ValueError when a secret would travel without TLS to another machine, unless allowed."""
    if secret is not None and tls_ca_file is None and not allow_plaintext_secret and not is_loopback(addr):
        raise ValueError(f"refusing to send a secret without TLS to {addr}: pass a TLS CA file, "
                         "or allow plaintext explicitly (--allow-plaintext-secret) on a trusted network")


def client_channel(addr: str, tls_ca_file: str | None = None, secret: SharedSecret | None = None,
                   options: Sequence[tuple[str, object]] = (), allow_plaintext_secret: bool = False) -> grpc.Channel:
    """A sync channel: TLS trusting `tls_ca_file` when given (else plaintext), `secret` on every call.
    A secret is never sent in plaintext to a non-loopback address unless `allow_plaintext_secret`."""
    check_plaintext_secret(addr, tls_ca_file, secret, allow_plaintext_secret)
    if tls_ca_file is None:
        channel = grpc.insecure_channel(addr, options=list(options))
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
        channel = grpc.secure_channel(addr, credentials, options=list(options))
    return channel if secret is None else grpc.intercept_channel(channel, _WithMetadata(secret.metadata()))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for a tenant token (empty without one)."""
    return () if token is None else ((AUTH_HEADER, f"Bearer {token}"),)
