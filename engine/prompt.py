"""Turning a request's input (raw text, chat messages or token ids) into validated prompt ids."""

from __future__ import annotations

from engine.errors import InvalidArgument

ROLES = ("system", "user", "assistant")


class PromptBuilder:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def build(self, prompt: str | None, messages: list[dict] | None, input_ids: list[int] | None) -> list[int]:
        given = [x is not None for x in (prompt, messages, input_ids)]
        if sum(given) != 1:
            raise InvalidArgument("give exactly one of: prompt text, chat messages, or input token ids")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt.strip():
                raise InvalidArgument("prompt is empty; send some text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif messages is not None:
            ids = self.chat_ids(messages)
        else:
            ids = self.check_ids(input_ids)
        if not ids:
            raise InvalidArgument("prompt is empty after tokenization")
        return ids

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("messages must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise InvalidArgument(f"message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r:.80}")
        if not any(m["content"].strip() for m in messages):
            raise InvalidArgument("all messages are empty; send some text")
        if self.tokenizer.chat_template is None:
            raise InvalidArgument("this model has no chat template; send a raw prompt or token ids instead")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
        return list(out)

    def check_ids(self, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidArgument("input_ids is empty; send at least one token id")
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise InvalidArgument("input_ids must be integers") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidArgument(f"input ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return ids
