"""A request's id in every log line written on its behalf.

`REQUEST_ID` is a context variable: the HTTP middleware and the gRPC servicer set it per call, and
asyncio copies it into the tasks a call starts, so lines logged while serving that call carry it.
`RequestIdFilter` (on the CLI's log handler) puts it on each record, for the text format's suffix
and the JSON format's `request_id` field."""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("trserve_request_id", default=None)
HEADER = "x-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:+=/@-]{1,128}")  # what is echoed and logged as given


def request_id(given: str | None) -> str:
    """The caller's id when it is a plain token (up to 128 of [A-Za-z0-9._:+=/@-]), else a new one: an id
    is echoed in headers and logs, so nothing else is taken from a caller."""
    if given and _SANE.fullmatch(given):
        return given
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        record.request_id = rid
        record.request_suffix = f" [request {rid}]" if rid else ""
        return True
