"""Store failures logged at most once per LOG_EVERY_S per kind (the embedded store's drafting and
the tenants' histories share the rule)."""

from __future__ import annotations

import logging
import threading
import time

from ...core.errors import TRServeError

log = logging.getLogger("trserve.worker")
LOG_EVERY_S = 60.0


class Throttle:
    """Store failures logged at most once per LOG_EVERY_S per kind, with how many were not logged
    since: a full store refuses every new tenant's request, and one traceback per request floods
    the log (each such request still counts in trserve_draft_fallbacks)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}
        self._lock = threading.Lock()

    def failed(self, what: str, tenant: str, exc: Exception, then: str = "drafting locally") -> None:
        kind = f"{what}:{type(exc).__name__}"
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -LOG_EVERY_S) < LOG_EVERY_S:
                self._skipped[kind] = self._skipped.get(kind, 0) + 1
                return
            self._last[kind], skipped = now, self._skipped.pop(kind, 0)
        more = f" ({skipped} more since the last report)" if skipped else ""
        if isinstance(exc, TRServeError):  # an expected refusal (full, unavailable, fenced): no traceback
            log.warning("matrix %s failed for tenant %s: %s; %s%s", what, tenant, exc, then, more)
        else:
            log.error("matrix %s failed for tenant %s; %s%s", what, tenant, then, more, exc_info=exc)
