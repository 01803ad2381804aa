"""Turning a request's input (raw text, chat messages or token ids) into validated prompt ids."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from ...core.errors import InvalidArgument
from .chat import ChatOptions
from .history import call_strings, chat_turns, fold_calls, reads_tool_calls


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "input ids") -> list[int]:
    """ids as a list of ints, each in [0, vocab_size); else InvalidArgument naming `what`."""
    try:
        out = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise InvalidArgument(f"{what} must be integers") from None
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise InvalidArgument(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return out


class PromptBuilder:
    def __init__(self, tokenizer, vocab_size: int, tool_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.tool_template = tool_template  # renders a chat with tools (engine/request/tools.py)
        # the text forms of the tokenizer's special (control) tokens, e.g. `<|im_end|>`
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.control_texts = tuple(t.content for t in added.values() if getattr(t, "special", False) and t.content)

    def build(self, prompt: str | None, messages: Sequence[dict] | None, input_ids: Sequence[int] | None,
              chat: ChatOptions | None = None, tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt ids from exactly one of the three inputs (GenerationRequest checked that); `chat`: how
        messages are templated (None: the defaults); `tools`: described by the template (tools.py)."""
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt.strip():
                raise InvalidArgument("prompt is empty; send some text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif messages is not None:
            ids = self.chat_ids(messages, chat, tools)
        else:
            if not isinstance(input_ids, (list, tuple)) or not input_ids:
                raise InvalidArgument("input_ids is empty; send at least one token id")
            ids = check_token_ids(input_ids, self.vocab_size)
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization")
        return ids

    def chat_ids(self, messages: Sequence[dict], chat: ChatOptions | None = None,
                 tools: Sequence[dict] | None = None) -> list[int]:
        chat = chat or ChatOptions()
        turns = self._turns(messages, chat, tools)
        if any(t in m["content"] for m in turns for t in self.control_texts):
            return self._quoted_chat_ids(turns, chat, tools)
        return list(self._template(turns, chat, tokenize=True, tools=tools))

    def reply_prefix(self, messages: Sequence[dict], chat: ChatOptions | None = None,
                     tools: Sequence[dict] | None = None) -> str:
        """The prompt's text after its final message, where the reply starts: the template's own opening
        of the reply (e.g. `<|im_end|>`, `<|im_start|>assistant`, `<think>`), or with continue_final_message that
        message's content, which the reply continues. (A reasoning parser reads whether `<think>` is open.)"""
        chat = chat or ChatOptions()
        turns = self._turns(messages, chat, tools)
        if chat.continue_final_message:  # the prompt ends with that content (transformers cuts there)
            return turns[-1]["content"]
        marks = [f"\ue000{i}\ue001" for i in range(len(turns))]
        text = self._template([{**m, "content": mark} for m, mark in zip(turns, marks)], chat, tokenize=False,
                              tools=tools)
        return re.split("\ue000\\d+\ue001", text)[-1]

    def _turns(self, messages: Sequence[dict], chat: ChatOptions, tools: Sequence[dict] | None) -> list[dict]:
        """The messages checked (history.py: earlier tool calls, tool_call_id) as the template that renders
        them reads them: calls as content where it reads no tool_calls."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidArgument("messages must be a non-empty list of {role, content}")
        turns = chat_turns(messages)
        if not any(m["content"].strip() or m.get("tool_calls") for m in turns):
            raise InvalidArgument("all messages are empty; send some text")
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a raw prompt or token ids instead")
        chat.check_messages(turns)
        if any(t in s for s in chat.strings() for t in self.control_texts):  # never quoted: refused
            raise InvalidArgument("chat_template_kwargs spell the model's control tokens; remove them")
        if any(t in s for s in call_strings(turns) for t in self.control_texts):
            raise InvalidArgument("a message's tool calls, tool_call_id or name spell the model's control tokens "
                                  "(e.g. <|im_end|>); remove them")
        template = self.tool_template if tools else self.tokenizer.chat_template
        return turns if reads_tool_calls(template) else fold_calls(turns)

    def _template(self, messages: list[dict], chat: ChatOptions, tokenize: bool, tools: Sequence[dict] | None = None):
        from jinja2 import TemplateError

        extra = dict(chat.template_kwargs)
        if chat.continue_final_message:
            extra["continue_final_message"] = True
        if tools:  # the template that renders them (a ChatML model's own may have no tool format)
            if self.tool_template is None:
                raise InvalidArgument("this model has no chat template to describe tools with")
            if any(t in json.dumps(list(tools), ensure_ascii=False) for t in self.control_texts):
                raise InvalidArgument("tools spell the model's control tokens (e.g. <|im_end|>) in a name, "
                                      "description or schema; remove them")
            extra.update(tools=list(tools), chat_template=self.tool_template)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=chat.add_generation_prompt,
                                                      tokenize=tokenize, return_dict=False, **extra)
        except TemplateError as exc:  # the template's own checks (e.g. roles must alternate): the caller's to fix
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
            if chat.is_default:  # nothing of the caller's but the messages: the server's fault
                raise
            if chat.continue_final_message and isinstance(exc, ValueError):  # transformers' own check
                raise InvalidArgument("continue_final_message: the chat template does not write the final "
                                      "message's content as it is, so it cannot be continued") from None
            raise InvalidArgument(f"the model's chat template failed with these chat_template_kwargs: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}") from None

    def _quoted_chat_ids(self, turns: list[dict], chat: ChatOptions,
                         tools: Sequence[dict] | None = None) -> list[int]:
        """Chat content is text: where it spells a control token (`<|im_start|>system`...), those
        characters are tokenized as plain text, so end-user content cannot forge turns. The template is
        rendered with a placeholder per non-empty content (an empty one stays empty: templates test it);
        the template's own text keeps its control tokens."""
        if any("\ue000" in m["content"] for m in turns):
            raise InvalidArgument("message content holds private-use characters U+E000; remove them")
        marked = [i for i, m in enumerate(turns) if m["content"]]
        shown = [{**m, "content": f"\ue000{i}\ue001"} if m["content"] else m for i, m in enumerate(turns)]
        text = self._template(shown, chat, tokenize=False, tools=tools)
        pieces = re.split("\ue000(\\d+)\ue001", text)  # template, index, template, index, ..., template
        seen = [int(i) for i in pieces[1::2]]
        # each content once, in order; only a turn with tool calls may go unshown (Mistral's shows its calls alone)
        if seen != sorted(set(seen)) or set(seen) - set(marked) or \
                any(i not in seen for i in marked if not turns[i].get("tool_calls")):
            raise InvalidArgument("message content spells the model's control tokens, which its chat template "
                                  "cannot quote as text; remove them from the content")
        tok, ids = self.tokenizer, []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids += tok(turns[int(piece)]["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
            elif piece:
                ids += tok(piece, add_special_tokens=False)["input_ids"]
        return ids
