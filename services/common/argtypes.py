"""Argument types that check a flag's range where it is parsed, so a bad value (on the command line
or in its TRSERVE_* variable) is refused naming that flag or variable, before anything starts.
The configs check the same ranges again for callers that build them directly."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def integer(lo: int, hi: int | None = None, meaning: str = "") -> Callable[[str], int]:
    """An int in [lo, hi]; `meaning` explains special values ("0 = off") in the error."""
    bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; it must be {bound}{note}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{value} is out of range: it must be {bound}{note}")
        return value

    parse.__name__ = "integer"
    return parse


def seconds(lo: float = 0.0, meaning: str = "", above: bool = False) -> Callable[[str], float]:
    """A finite float >= lo (> lo when `above`; nan and inf refused)."""
    note = f" ({meaning})" if meaning else ""
    bound = f"{'>' if above else '>='} {lo:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (math.isfinite(value) and (value > lo if above else value >= lo)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be a finite number {bound}{note}")
        return value

    parse.__name__ = "seconds"
    return parse


def port(off: int | None = None) -> Callable[[str], int]:
    """A TCP port 0..65535 (0 = any free one), or `off` where the flag has an off value."""
    meaning = "0 = any free port" + (f", {off} = off" if off is not None else "")
    inner = integer(0, 65535, meaning)

    def parse(text: str) -> int:
        if off is not None and text.strip() == str(off):
            return off
        return inner(text)

    parse.__name__ = "port"
    return parse


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return level


def redis_url(text: str) -> str:
    """redis://, rediss:// or unix:// (what redis-py's from_url takes)."""
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Redis URL: use redis://HOST:PORT/DB, rediss://... "
                                         "(TLS) or unix://PATH")
    return text
