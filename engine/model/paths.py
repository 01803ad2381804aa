"""Where trserve keeps what it builds once per machine: converted models, compiled kernels,
calibrations (read when called, never at import time)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/trserve, else ~/.cache/trserve."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trserve"
