"""The reasoning parsers `--reasoning-parser` names (reasoning.py applies them): each the tags around a
reply's reasoning, None for none. Data only, so the command line lists them without importing the API."""

from __future__ import annotations

THINK = ("<think>", "</think>")
# `think`; vLLM's names for the same tags (DeepSeek-R1, QwQ, Qwen3), so its flags carry over
PARSERS: dict[str, tuple[str, str] | None] = {"none": None, "think": THINK, "deepseek_r1": THINK, "qwen3": THINK}
