"""Incremental detokenization of committed tokens into text deltas."""

from __future__ import annotations


class TextStream:
    """Turns growing token ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sent = ""

    def delta(self, ids: list[int], final: bool = False, cut=None) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if cut is not None:
            text = cut(text)
        if not final and text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.sent):
            # A merge changed earlier characters (rare); send nothing rather than contradict the past.
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out
