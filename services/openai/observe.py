"""What an operator sees of each HTTP call: its request id and one access log line.

`RequestLog` is ASGI middleware around the API: it takes the caller's `X-Request-Id` (a plain token)
or makes one, echoes it in the response headers, sets it as the log context of everything the call
logs (services/common/logcontext.py), and when the response has ended writes one line to the
`trserve.access` logger: method, path, status, tenant, prompt+completion tokens, milliseconds.
Handlers report tenant and token counts through `request.state` (`tenant`, `tokens`). Probes of
/health and /metrics are logged at DEBUG only, so they do not bury the calls."""

from __future__ import annotations

import logging
import time

from ..common.logcontext import HEADER, REQUEST_ID, request_id

access = logging.getLogger("trserve.access")
QUIET_PATHS = ("/health", "/metrics")


class RequestLog:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(HEADER.encode(), b"").decode("latin-1") or None
        rid = request_id(given)
        context = REQUEST_ID.set(rid)
        state = scope.setdefault("state", {})
        status = [0]
        started = time.perf_counter()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (HEADER.encode(), rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            ms = (time.perf_counter() - started) * 1000
            tokens = state.get("tokens")
            level = logging.DEBUG if scope.get("path") in QUIET_PATHS else logging.INFO
            # the id goes on the line through the log context (a text suffix, a JSON field)
            access.log(level, "%s %s -> %s tenant=%s tokens=%s ms=%.0f", scope.get("method"), scope.get("path"),
                       status[0] or "none (client gone)", state.get("tenant", "-"),
                       f"{tokens[0]}+{tokens[1]}" if tokens else "-", ms)
            REQUEST_ID.reset(context)
