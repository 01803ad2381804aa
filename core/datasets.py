"""The prompt sets bundled with trserve (core/data/, ~400 KB): what the tests, `trserve bench` and
`trserve tune` read by default, so a clone needs nothing beside it."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
PROMPT_SETS = ("spec_bench", "mbpp", "repetitive", "structured")
AGENT_TASKS = DATA_DIR / "agent" / "tasks.json"  # `trserve bench --agent`'s conversations and tools


def prompt_file(name: str = "spec_bench") -> Path:
    """The bundled jsonl of a prompt set (one of PROMPT_SETS)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; bundled: {', '.join(PROMPT_SETS)}")
    return DATA_DIR / name / "dev.jsonl"


def agent_file() -> Path:
    """The bundled agent workload: its tools, their data and its tasks (bench/agent_tools.py reads it)."""
    return AGENT_TASKS
