"""Authentication and TLS for trserve servers and clients.

- Tenant tokens (workers): callers send `authorization: Bearer <token>`; a token file maps each
  tenant to its token(s). A missing or unknown token is UNAUTHENTICATED; a valid token used for
  another tenant's request is PERMISSION_DENIED.
- Shared secret (matrix service): workers send `authorization: Bearer <secret>`; anything else is
  UNAUTHENTICATED.
- TLS: a server serves with a PEM certificate and key; a client trusts a PEM CA file.

Health and reflection stay open (orchestrators probe them without credentials). Secrets are read
from files, never from flags (flags show in `ps`), and never printed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from matrix_store.config import validate_tenant_id

AUTH_HEADER = "authorization"
MIN_SECRET_CHARS = 16
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # method prefixes that need no credentials


def _read_text(path: str | Path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {str(path)!r}: {exc.strerror or exc}") from None


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
    """token hash -> tenant, from a JSON file {"tenant": "token" or ["token", ...]} (lists allow rotation)."""

    by_digest: dict[bytes, str] = field(repr=False)

    @classmethod
    def from_mapping(cls, mapping: object) -> TenantTokens:
        if not isinstance(mapping, dict) or not mapping:
            raise ValueError('the tenant token file must be a JSON object {"tenant": "token" or ["token", ...]}')
        by_digest: dict[bytes, str] = {}
        for tenant, tokens in mapping.items():
            validate_tenant_id(tenant)
            for token in [tokens] if isinstance(tokens, str) else tokens:
                if not isinstance(token, str):
                    raise ValueError(f"tenant {tenant!r}: tokens must be strings")
                digest = _digest(_check_secret(token, f"each token (tenant {tenant!r})"))
                if by_digest.setdefault(digest, tenant) != tenant:
                    raise ValueError(f"tenants {by_digest[digest]!r} and {tenant!r} share a token; give each its own")
        return cls(by_digest)

    @classmethod
    def from_file(cls, path: str | Path) -> TenantTokens:
        try:
            mapping = json.loads(_read_text(path, "tenant token"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"the tenant token file {str(path)!r} is not JSON: {exc}") from None
        return cls.from_mapping(mapping)

    def tenant_of(self, token: str) -> str | None:
        return self.by_digest.get(_digest(token))


def load_tokens_by_tenant(path: str | Path) -> dict[str, str]:
    """Client side: tenant -> the first token listed for it in a tenant token file."""
    mapping = json.loads(_read_text(path, "tenant token"))
    TenantTokens.from_mapping(mapping)  # same validation as the server's
    return {tenant: tokens if isinstance(tokens, str) else tokens[0] for tenant, tokens in mapping.items()}


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


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    async def refuse(request, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

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
        return self.authorize(token, handler)

    def authorize(self, token: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class SharedSecretAuth(_BearerAuth):
    """The matrix service: every call but health/reflection must carry the shared secret."""

    what = "shared secret"

    def __init__(self, secret: SharedSecret) -> None:
        self._secret = secret

    def authorize(self, token: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if self._secret.matches(token):
            return handler
        return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "wrong shared secret")


class TenantAuth(_BearerAuth):
    """A worker: the token names a tenant; a request naming another tenant (an empty tenant
    means `default_tenant`) is refused. Requests without a tenant field need any valid token."""

    what = "tenant token"

    def __init__(self, tokens: TenantTokens, default_tenant: str) -> None:
        self._tokens, self._default = tokens, default_tenant

    def authorize(self, token: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        tenant = self._tokens.tenant_of(token)
        if tenant is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "unknown tenant token")
        if handler.request_streaming:  # no such rpc in the Generate API; the request is not visible here
            return handler
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

        async def check(request, context: grpc.aio.ServicerContext) -> None:
            asked = getattr(request, "tenant", None)
            if asked is not None and (asked or self._default) != tenant:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"this token belongs to another tenant than {asked or self._default!r}")

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


def client_channel(addr: str, tls_ca_file: str | None = None, secret: SharedSecret | None = None,
                   options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A sync channel: TLS trusting `tls_ca_file` when given (else plaintext), `secret` on every call."""
    if tls_ca_file is None:
        channel = grpc.insecure_channel(addr, options=list(options))
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
        channel = grpc.secure_channel(addr, credentials, options=list(options))
    return channel if secret is None else grpc.intercept_channel(channel, _WithMetadata(secret.metadata()))


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for a tenant token (empty without one)."""
    return () if token is None else ((AUTH_HEADER, f"Bearer {token}"),)
