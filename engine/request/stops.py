"""Stop conditions over committed tokens: stop token ids and stop strings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopResult:
    keep: int  # how many of the offered tokens to keep
    reason: str | None  # "eos" (stop token id), "stop" (stop string) or None


class StopChecker:
    """Decides where generation stops inside a batch of newly committed tokens.

    A stop token id ends generation and is kept in the ids (as transformers' generate does);
    a stop string ends generation at the token that completes it, and is cut from the text.
    """

    def __init__(self, tokenizer, stop_token_ids: set[int], stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._window = max((len(s) for s in self.stop_strings), default=0) + 8  # tokens of look-back

    def check(self, generated: list[int], new: list[int]) -> StopResult:
        """generated: ids committed before; new: ids committed this step."""
        for i, t in enumerate(new):
            if t in self.stop_token_ids:
                new = new[: i + 1]
                reason = "eos"
                break
        else:
            reason = None
        if self.stop_strings:
            for i in range(len(new)):
                if self._completes_stop(generated, new[: i + 1]):
                    return StopResult(keep=i + 1, reason="stop")
        return StopResult(keep=len(new), reason=reason)

    def _completes_stop(self, generated: list[int], new: list[int]) -> bool:
        before = generated[-self._window :]
        # Characters the earlier tokens did not complete yet (bytes of a multi-byte character decode
        # to U+FFFD) may be completed by `new`: a stop string may start there.
        old = self.tokenizer.decode(before, skip_special_tokens=True).rstrip("\ufffd")
        text = self.tokenizer.decode(before + new, skip_special_tokens=True)
        for s in self.stop_strings:
            pos = text.find(s, max(0, len(old) - len(s) + 1))
            if pos >= 0:
                return True
        return False

    def cut_text(self, text: str) -> str:
        """Text up to (not including) the first stop string."""
        cut = len(text)
        for s in self.stop_strings:
            pos = text.find(s)
            if 0 <= pos < cut:
                cut = pos
        return text[:cut]
