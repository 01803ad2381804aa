"""Progress of long runs (`trserve bench`, `trserve tune`, calibration): units done / total,
tokens/s so far per decoder, time left.

On a terminal it is one line rewritten in place (`\\r`); anywhere else (a log file, CI) it is a
plain log line at most every `every_s` seconds and at the end, so logs stay readable. Lives in
core/ because bench/ and engine/tuning/ both use it and engine/ may not import bench/.

    with Progress("bench", total=26, unit="prompts") as progress:
        for q in questions:
            progress.add("tr", tokens=128, seconds=2.4)  # per decode, per decoder
            progress.step(note=q["category"])
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Self, TextIO

log = logging.getLogger("trserve.progress")


def format_duration(seconds: float) -> str:
    """45 -> '45s', 185 -> '3m05s', 3720 -> '1h02m'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Counts units of work (prompts, calibration cells) and tokens per decoder; renders after each step."""

    def __init__(self, label: str, total: int, *, unit: str = "prompts", stream: TextIO | None = None,
                 tty: bool | None = None, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.label, self.total, self.unit = label, total, unit
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty() if tty is None else tty
        self._every_s, self._clock, self._log = every_s, clock, logger
        self._start = clock()
        self._last_render: float | None = None
        self._width = 0  # length of the last tty line, to blank what a shorter one leaves
        self.done = 0
        self.tokens: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def add(self, decoder: str, tokens: int, seconds: float) -> None:
        """One decode by `decoder`: its tokens and the time it took (the tokens/s shown are these sums)."""
        self.tokens[decoder] = self.tokens.get(decoder, 0) + tokens
        self.seconds[decoder] = self.seconds.get(decoder, 0.0) + seconds

    def rate(self, decoder: str) -> float:
        seconds = self.seconds.get(decoder, 0.0)
        return self.tokens.get(decoder, 0) / seconds if seconds > 0 else 0.0

    def left_s(self) -> float | None:
        """Estimated seconds left, from the mean wall time per unit so far; None before the first."""
        if not self.done:
            return None
        return (self._clock() - self._start) / self.done * max(self.total - self.done, 0)

    def line(self, note: str = "") -> str:
        parts = [f"{self.label}: {self.done}/{self.total} {self.unit}" + (f" ({note})" if note else "")]
        if self.tokens:
            parts.append(", ".join(f"{d} {self.rate(d):.1f} tok/s" for d in self.tokens))
        left = self.left_s()
        elapsed = format_duration(self._clock() - self._start)
        parts.append(f"{elapsed} elapsed" + ("" if left is None else f", ~{format_duration(left)} left"))
        return " | ".join(parts)

    def step(self, n: int = 1, note: str = "") -> None:
        """`n` more units done; render now if due (the last unit always renders)."""
        self.done += n
        now = self._clock()
        interval = 0.1 if self._tty else self._every_s
        if self.done < self.total and self._last_render is not None and now - self._last_render < interval:
            return
        self._last_render = now
        self._render(self.line(note))

    def _render(self, text: str) -> None:
        if not self._tty:
            self._log.info("%s", text)
            return
        pad = " " * max(self._width - len(text), 0)
        self._width = len(text)
        self._stream.write(f"\r{text}{pad}")
        self._stream.flush()

    def close(self) -> None:
        """End the terminal line (later output starts on a fresh one)."""
        if self._tty and self._width:
            self._stream.write("\n")
            self._stream.flush()
            self._width = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
