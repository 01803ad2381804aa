"""How chat messages become a prompt besides the messages themselves: vLLM's request fields
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message`, the same over gRPC
(ChatMessages) and HTTP. Checked here once, with one message each, naming the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ...core.errors import InvalidArgument

MAX_KWARGS_BYTES = 8192  # the kwargs as compact JSON
MAX_KWARGS = 32  # top-level names
MAX_DEPTH = 4  # nesting of lists and objects below the top level
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# names apply_chat_template takes itself, or that the template reads as the tokenizer's special tokens:
# a kwarg of that name would change how the prompt is built, not the template's own switches
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens"})


@dataclass(frozen=True)
class ChatOptions:
    """`template_kwargs`: extra variables the chat template sees (e.g. Qwen3's {"enable_thinking": false}),
    JSON values only. `add_generation_prompt`: open the assistant's turn after the messages (default).
    `continue_final_message`: leave the final message, an assistant turn, open so the reply continues
    it (no generation prompt; giving both true is an error, as in vLLM)."""

    template_kwargs: Mapping[str, object] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "template_kwargs", MappingProxyType(check_template_kwargs(self.template_kwargs)))
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidArgument("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false to continue the final (assistant) message")

    @property
    def is_default(self) -> bool:
        return not self.template_kwargs and self.add_generation_prompt and not self.continue_final_message

    def check_messages(self, messages: object) -> None:
        """continue_final_message needs a final assistant message to continue."""
        last = messages[-1] if isinstance(messages, (list, tuple)) and messages else None
        if self.continue_final_message and (not isinstance(last, Mapping) or last.get("role") != "assistant"):
            role = last.get("role") if isinstance(last, Mapping) else None
            raise InvalidArgument(f"continue_final_message needs the final message to be the assistant's turn to "
                                  f"continue; it is {role!r}")

    def strings(self) -> list[str]:
        """Every string in the kwargs, keys included (checked for control tokens by the prompt builder)."""
        out: list[str] = []
        _strings(dict(self.template_kwargs), out)
        return out


def check_template_kwargs(kwargs: object) -> dict:
    """`kwargs` as a plain dict: a JSON object whose names are identifiers (none that apply_chat_template
    takes itself), whose values are JSON values (strings, finite numbers, booleans, null, and lists and
    objects of those nested at most MAX_DEPTH deep), at most MAX_KWARGS names and MAX_KWARGS_BYTES bytes."""
    if not isinstance(kwargs, Mapping):
        raise InvalidArgument(f"chat_template_kwargs must be a JSON object of names to values, got "
                              f"{type(kwargs).__name__}")
    if len(kwargs) > MAX_KWARGS:
        raise InvalidArgument(f"chat_template_kwargs has {len(kwargs)} names; at most {MAX_KWARGS}")
    for name in kwargs:
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidArgument(f"chat_template_kwargs: {name!r} is not a name ([A-Za-z_][A-Za-z0-9_]*, "
                                  "at most 64 characters)")
        if name in RESERVED:
            raise InvalidArgument(f"chat_template_kwargs: {name!r} is set by the server, not by a template "
                                  "variable; leave it out (add_generation_prompt and continue_final_message are "
                                  "fields of their own)")
    out = {name: _plain(value, name, 0) for name, value in kwargs.items()}
    size = len(json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_KWARGS_BYTES:
        raise InvalidArgument(f"chat_template_kwargs is {size} bytes as JSON; at most {MAX_KWARGS_BYTES}")
    return out


def _plain(value: object, at: str, depth: int) -> object:
    """A copy of a JSON value (what a template may read), else InvalidArgument naming where it is."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidArgument(f"chat_template_kwargs.{at} must be a finite number, got {value!r}")
        return value
    if depth >= MAX_DEPTH and isinstance(value, (list, tuple, Mapping)):
        raise InvalidArgument(f"chat_template_kwargs.{at} nests lists or objects more than {MAX_DEPTH} deep")
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{at}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _plain(v, f"{at}.{k}", depth + 1) for k, v in value.items()}
    raise InvalidArgument(f"chat_template_kwargs.{at} must be a JSON value (string, number, boolean, null, list "
                          f"or object), got {type(value).__name__}")


def _strings(value: object, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            out.append(k)
            _strings(v, out)


def chat_options_from_json(kwargs_json: str, add_generation_prompt: bool = True,
                           continue_final_message: bool = False) -> ChatOptions | None:
    """ChatOptions from the wire's spelling (gRPC ChatMessages: the kwargs as JSON text, "" = none);
    None where every option is its default."""
    kwargs: object = {}
    if kwargs_json:
        if len(kwargs_json) > 4 * MAX_KWARGS_BYTES:
            raise InvalidArgument(f"chat_template_kwargs is {len(kwargs_json)} characters; at most "
                                  f"{MAX_KWARGS_BYTES} bytes as compact JSON")
        try:
            kwargs = json.loads(kwargs_json)
        except (ValueError, RecursionError):
            raise InvalidArgument("chat_template_kwargs is not valid JSON (a JSON object of names to values)") from None
    options = ChatOptions(kwargs, add_generation_prompt, continue_final_message)
    return None if options.is_default else options
