"""vLLM's chat request fields that shape the prompt: `chat_template_kwargs`, `add_generation_prompt` and
`continue_final_message` (checked by engine/request/chat.py:ChatOptions, the same over gRPC), onto the
engine request's `chat` option; a bad value is a 400 naming its field."""

from __future__ import annotations

from ...core.errors import InvalidArgument
from ...engine.request.chat import ChatOptions, check_template_kwargs
from .errors import BadParam

DEFAULTS = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False}


def chat_options(body: dict, kind: str, messages: list[dict] | None) -> ChatOptions | None:
    """The request's ChatOptions (None where every field is its default). On completions (`kind` "text")
    the fields have no messages to shape: a value other than the default is a 400."""
    given = {name: body[name] for name in DEFAULTS if body.get(name) is not None}
    if kind != "chat":
        for name, value in given.items():
            if value != DEFAULTS[name]:
                raise BadParam(f"{name} applies to chat messages: use /v1/chat/completions", name)
        return None
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(given.get(name, False), bool):
            raise BadParam(f"{name} must be true or false, got {given[name]!r}", name)
    try:
        kwargs = check_template_kwargs(given.get("chat_template_kwargs", {}))
    except InvalidArgument as exc:
        raise BadParam(str(exc), "chat_template_kwargs") from None
    try:
        options = ChatOptions(kwargs, given.get("add_generation_prompt", True), given.get("continue_final_message", False))
        options.check_messages(messages)
    except InvalidArgument as exc:
        raise BadParam(str(exc), "continue_final_message") from None
    return None if options.is_default else options
