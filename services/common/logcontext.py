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
# what could end or rewrite a log line on a terminal or in a line-based collector: C0 and C1 controls
# (newline, carriage return, escape sequences), DEL, and Unicode's line and paragraph separators
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """`text` with each control character written as its Python escape (\\n, \\x1b, \\u2028): a logged
    value a caller controls (a decoded path, a header, a tenant, a model name) stays on its own line."""
    return _CONTROLS.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


class TextFormatter(logging.Formatter):
    """The text log format, one line per record: the message's control characters escaped (a traceback,
    when there is one, follows on lines of its own as Python writes it)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


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
