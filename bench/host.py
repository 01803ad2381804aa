"""The host a figure was measured on: its CPU and the ISA flags that decide the kernels, written into
every bench report and printed at the head of every table (figures from hosts with and without
AVX-512 or VNNI differ by 2x)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

_FLAG_PREFIXES = ("avx512", "avx2", "avx_vnni", "amx", "fma", "f16c")


def host_facts() -> dict:
    """{"cpu": model name, "isa_flags": [...], "kernel_isas": the kernel variants it runs, "threads"}."""
    from ..engine.model.kernels.build import _cpu_flags, available_isas

    flags = sorted(f for f in _cpu_flags() if f.startswith(_FLAG_PREFIXES))
    info = Path("/proc/cpuinfo")
    model = next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")),
                 platform.processor()) if info.exists() else platform.processor()
    return {"cpu": model, "isa_flags": flags, "kernel_isas": available_isas(), "threads": torch.get_num_threads()}


def host_line(facts: dict) -> str:
    """One line naming the host of a table: CPU, threads, ISA flags."""
    flags = " ".join(facts.get("isa_flags", [])) or "no AVX2/AVX-512 flags"
    return f"host: {facts.get('cpu', '?')}, {facts.get('threads', '?')} threads; {flags}"
