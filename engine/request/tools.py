"""Which chat template renders a request's tools (tool_choice "auto", issue 59).

A model's own template renders them where it has a tool format (it names `tools`: Qwen2.5's, Llama
3.1's, Mistral's). A ChatML model whose own template has none (the bundled SmolLM2-135M-Instruct) gets
the template shipped beside this file, `templates/chatml_tools.jinja`: ChatML with Hermes / Qwen2.5
tool calls. A template given by `--chat-template` is always the one used, tools or not.
"""

from __future__ import annotations

from pathlib import Path

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
