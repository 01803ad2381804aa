"""The OpenAI API's request errors: a bad field names itself (OpenAI's error.param)."""

from __future__ import annotations

from ...core.errors import InvalidArgument


class BadParam(InvalidArgument):
    """An invalid request field; `param` names it (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(BadParam):
    status = "NOT_FOUND"
