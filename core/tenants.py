"""Tenant ids: what a valid id is, and the reserved namespace of the matrix store's own matrices.

Used by both services (request validation, token files) and the matrix store, so it lives here:
no torch, grpc, redis or numpy.
"""

from __future__ import annotations

import re

from .errors import InvalidArgument

# Ids starting with this are reserved for the store's own matrices: callers (requests) never name
# them; only administration (an admin credential) may write them.
RESERVED_PREFIX = "_"
# Reserved tenant whose matrix every tenant without its own (or a domain's) starts from.
GLOBAL_TENANT = "_global"
# A domain D's matrix is the reserved tenant "_domain.D": domains never share a namespace with
# tenants, so naming a domain can never read another tenant's matrix.
DOMAIN_PREFIX = "_domain."

# Tenant ids become parts of Redis keys; keeping them to this alphabet (no ':') keeps keys unambiguous.
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_INTERNAL_RE = re.compile(r"_[A-Za-z0-9._-]{1,72}")


def validate_tenant_id(tenant: object, what: str = "tenant", reserved_ok: bool = False) -> str:
    """Return `tenant` if it is a valid tenant id, else raise InvalidArgument saying what is allowed.
    Ids starting with "_" are reserved (`_global`, `_domain.*`): refused unless `reserved_ok`
    (administration only)."""
    if reserved_ok and isinstance(tenant, str) and _INTERNAL_RE.fullmatch(tenant) is not None:
        return tenant
    if not isinstance(tenant, str) or _TENANT_RE.fullmatch(tenant) is None:
        raise InvalidArgument(
            f"{what} id {tenant!r} is invalid: use 1-64 characters from A-Z a-z 0-9 . _ -"
        )
    if tenant.startswith(RESERVED_PREFIX):
        raise InvalidArgument(f"{what} id {tenant!r} is reserved: ids starting with '_' belong to the service "
                              f"(e.g. {GLOBAL_TENANT}); use an id starting with A-Z a-z 0-9 . -")
    return tenant


def is_reserved(tenant: str) -> bool:
    return tenant.startswith(RESERVED_PREFIX)


def domain_tenant(domain: str) -> str:
    """The reserved tenant holding domain `domain`'s matrix."""
    return DOMAIN_PREFIX + domain
