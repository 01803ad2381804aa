"""Turning a request's input (raw text, chat messages or token ids) into validated prompt ids."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import InvalidArgument

ROLES = ("system", "user", "assistant")


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
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def build(self, prompt: str | None, messages: Sequence[dict] | None, input_ids: Sequence[int] | None) -> list[int]:
        """Prompt ids from exactly one of the three inputs (GenerationRequest checked that)."""
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt.strip():
                raise InvalidArgument("prompt is empty; send some text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif messages is not None:
            ids = self.chat_ids(messages)
        else:
            if not isinstance(input_ids, (list, tuple)) or not input_ids:
                raise InvalidArgument("input_ids is empty; send at least one token id")
            ids = check_token_ids(input_ids, self.vocab_size)
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization")
        return ids

    def chat_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidArgument("messages must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise InvalidArgument(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r:.80}")
        if not any(m["content"].strip() for m in messages):
            raise InvalidArgument("all messages are empty; send some text")
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a raw prompt or token ids instead")
        from jinja2 import TemplateError

        try:
            out = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                                     return_dict=False)
        except TemplateError as exc:  # the template's own checks (e.g. roles must alternate): the caller's to fix
            raise InvalidArgument(f"the model's chat template refused these messages: {exc}") from None
        return list(out)
