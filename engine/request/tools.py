"""Which chat template renders a request's tools (tool_choice "auto", issue 59).

A model's own template renders them where it has a tool format (it names `tools`: Qwen2.5's, Llama
3.1's, Mistral's). A ChatML model whose own template has none (the bundled SmolLM2-135M-Instruct) gets
the template shipped beside this file, `templates/chatml_tools.jinja`: ChatML with Hermes / Qwen2.5
tool calls. A template given by `--chat-template` is always the one used, tools or not. The HTTP API
hands a request's tools here with tool_choice "auto"; gRPC's ChatMessages.tools as JSON text
(tools_from_json); both are checked by tool_functions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ...core.errors import InvalidArgument

SHIPPED = Path(__file__).resolve().parent / "templates" / "chatml_tools.jinja"
CHATML = ("<|im_start|>", "<|im_end|>")


def renders_tools(template: object) -> bool:
    """Whether a chat template's text reads the `tools` it is given."""
    return isinstance(template, str) and "tools" in template


def tool_template(template: object, custom: bool) -> str | None:
    """The template to render a request with tools by: `template` (the tokenizer's) where it renders
    tools or is the operator's own (`custom`: --chat-template), else the shipped hermes ChatML template
    where `template` is ChatML, else `template` (its tools unseen: tool_choice "auto" needs a format
    named by --tool-call-parser then)."""
    if not isinstance(template, str):
        return None
    if renders_tools(template) or custom or not all(t in template for t in CHATML):
        return template
    return SHIPPED.read_text()


MAX_TOOLS = 64  # as the HTTP API's tools list (services/openai/tools.py)
MAX_TOOLS_CHARS = 64 << 10  # the tools' JSON text
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def tools_from_json(text: str) -> tuple[dict, ...] | None:
    """A request's tools from the wire's spelling (gRPC ChatMessages.tools: the JSON text of OpenAI-style
    [{"type": "function", "function": {"name", "description"?, "parameters"?}}], "" = none), checked as
    the HTTP API checks its own; InvalidArgument naming what to fix.

    >>> tools_from_json('[{"type": "function", "function": {"name": "f"}}]')[0]["function"]["name"]
    'f'
    """
    if not text:
        return None
    if len(text) > MAX_TOOLS_CHARS:
        raise InvalidArgument(f"tools is {len(text)} characters; at most {MAX_TOOLS_CHARS}")
    try:
        tools = json.loads(text)
    except (ValueError, RecursionError):
        raise InvalidArgument('tools is not valid JSON (a JSON list of {"type": "function", "function": '
                              '{"name": ..., "parameters": ...}})') from None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise InvalidArgument(f"tools must be a JSON list of 1 to {MAX_TOOLS} function tools")
    tool_functions(tools)
    return tuple(tools)


def tool_functions(tools: object) -> dict[str, dict]:
    """OpenAI-style tools [{"type": "function", "function": {"name", "description"?, "parameters"?}}] ->
    name: function, checked (both APIs: the HTTP API maps the InvalidArgument to its `tools` param).

    >>> list(tool_functions([{"type": "function", "function": {"name": "f"}}]))
    ['f']
    """
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools must be a list of at most {MAX_TOOLS} functions")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise InvalidArgument(f'tools[{i}] must be {{"type": "function", "function": {{"name": '
                                  '[A-Za-z0-9_-]{1,64}, "description"?, "parameters"?}}')
        if not isinstance(f.get("parameters", {}), dict) or f["name"] in out:
            raise InvalidArgument(f"tools[{i}]: parameters must be a JSON Schema object and names distinct")
        out[f["name"]] = f
    return out
