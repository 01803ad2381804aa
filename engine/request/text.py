"""Incremental detokenization of committed tokens into text deltas, and the hold-back that keeps a
stream from sending any part of a stop string before it is known whether the stop completes."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_prefix_start(text: str, stop_strings: Sequence[str]) -> int:
    """Where the longest suffix of `text` that is a proper prefix of a stop string starts
    (len(text) when there is none). Example: "Say ex", stops ("example",) -> 4."""
    start = len(text)
    for s in stop_strings:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                start = min(start, len(text) - n)
                break
    return start


class HeldText:
    """The part of a growing text that may be streamed: everything but a trailing part that could
    still become a stop string (it is sent once the next text rules that out, or with the final
    message). Concatenated `push` results plus `rest(final_text)` equal the final text."""

    def __init__(self, stop_strings: Sequence[str] = ()) -> None:
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.seen = ""  # every delta pushed
        self.sent = ""  # what push has returned so far (a prefix of seen)

    def push(self, delta: str) -> str:
        """Add a step's delta; returns what may be sent now."""
        self.seen += delta
        safe = self.seen[: stop_prefix_start(self.seen, self.stop_strings)]
        out, self.sent = safe[len(self.sent):], safe  # safe only grows: it starts with sent
        return out

    def rest(self, final_text: str) -> str | None:
        """What the final message adds to what was sent; None if the final text contradicts it."""
        return final_text[len(self.sent):] if final_text.startswith(self.sent) else None


CONTEXT = 5  # ids decoded again before the new ones (TextStream)


def reply_decoder(tokenizer, kept: Sequence[int] = ()) -> Callable[[Sequence[int]], str]:
    """ids -> the reply's text: decoded without special tokens (vLLM's default skip_special_tokens), but
    each special id in `kept` written as its own text, with the ids between decoded as they would be
    after any special token (a tool-call marker the reply is read for: Mistral's `[TOOL_CALLS]` after
    text, which the parser must see)."""
    def plain(ids: Sequence[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    kept = frozenset(kept)
    if not kept:
        return plain

    def decode(ids: Sequence[int]) -> str:
        pieces, start = [], 0
        for i, t in enumerate(ids):
            if t in kept:
                pieces += [plain(ids[start:i]), tokenizer.decode([t], skip_special_tokens=False)]
                start = i + 1
        return "".join(pieces) + plain(ids[start:])
    return decode


class TextStream:
    """Turns growing token ids into text deltas, holding back incomplete UTF-8 sequences.

    Incremental: each call decodes only the ids since the last text it produced, with the CONTEXT ids
    before them (`_prefix:_read`), and appends the difference. Decoding the whole output every
    step cost O(length) a step (0.4 ms at 2048 tokens, per request) where this costs two short
    decodes. The text equals decoding every id at once where the tokenizer decodes ids independently
    of what precedes the context (byte-level BPE, SentencePiece); the final result decodes everything
    once anyway, and a stream never contradicts what it sent (below)."""

    def __init__(self, tokenizer, kept: Sequence[int] = ()) -> None:
        self.decode = reply_decoder(tokenizer, kept)  # kept: special ids whose text stays (reply_decoder)
        self.sent = ""
        self._text = ""  # the text of ids[:_read]
        self._prefix = self._read = 0  # ids[_prefix:_read]: the context the next ids are decoded after

    def delta(self, ids: list[int], final: bool = False, cut=None) -> str:
        decode = self.decode
        before = decode(ids[self._prefix: self._read]) if self._read else ""
        after = decode(ids[self._prefix:])
        if after.startswith(before):
            text = self._text + after[len(before):]
        else:  # the new ids changed how the context decodes (rare): decode them all
            text = decode(ids)
        if not text.endswith("\ufffd"):  # whole characters: the next call decodes after these, the last
            # CONTEXT ids as context (a SentencePiece decode drops the space that starts its first token)
            self._text, self._prefix, self._read = text, max(len(ids) - CONTEXT, 0), len(ids)
        if cut is not None:
            text = cut(text)
        if not final and text.endswith("\ufffd"):  # an incomplete character: held until the next ids
            return ""
        if not text.startswith(self.sent):
            # A merge changed earlier characters (rare); send nothing rather than contradict the past.
            return ""
        out, self.sent = text[len(self.sent) :], text
        return out
