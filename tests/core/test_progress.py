"""trserve.core.progress: the figures (done/total, tokens/s per decoder, time left) under a fake clock,
plain log lines off a terminal and one rewritten line on one."""

from __future__ import annotations

import io
import logging

import pytest

from trserve.core.progress import Progress, format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (44.6, "45s"), (185, "3m05s"), (3720, "1h02m")])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_non_tty_logs_a_line_per_step_with_running_figures(caplog) -> None:
    clock = FakeClock()
    progress = Progress("bench", total=4, tty=False, every_s=0.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="trserve.progress"):
        clock.now += 10
        progress.add("hf", tokens=100, seconds=5.0)
        progress.add("tr", tokens=100, seconds=2.0)
        progress.step(note="writing")
        clock.now += 30
        progress.add("hf", tokens=50, seconds=5.0)
        progress.add("tr", tokens=60, seconds=2.0)
        progress.step(note="coding")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bench: 1/4 prompts (writing) | hf 20.0 tok/s, tr 50.0 tok/s | 10s elapsed, ~30s left",
        "bench: 2/4 prompts (coding) | hf 15.0 tok/s, tr 40.0 tok/s | 40s elapsed, ~40s left",
    ]


def test_non_tty_lines_are_spaced_by_every_s_but_the_last_always_shows(caplog) -> None:
    clock = FakeClock()
    progress = Progress("calibrating", total=5, unit="timings", tty=False, every_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="trserve.progress"):
        for _ in range(5):
            clock.now += 4
            progress.step()
    assert [r.getMessage() for r in caplog.records] == [
        "calibrating: 1/5 timings | 4s elapsed, ~16s left",  # first step
        "calibrating: 4/5 timings | 16s elapsed, ~4s left",  # 12 s after the first
        "calibrating: 5/5 timings | 20s elapsed, ~0s left",  # the last one
    ]


def test_tty_rewrites_one_line_and_ends_it_on_close() -> None:
    clock, out = FakeClock(), io.StringIO()
    with Progress("tune cpu-8", total=2, tty=True, stream=out, clock=clock) as progress:
        clock.now += 1
        progress.add("cpu-8", 30, 1.0)
        progress.step(note="MAT 1.80")
        clock.now += 1
        progress.step()
    first = "tune cpu-8: 1/2 prompts (MAT 1.80) | cpu-8 30.0 tok/s | 1s elapsed, ~1s left"
    second = "tune cpu-8: 2/2 prompts | cpu-8 30.0 tok/s | 2s elapsed, ~0s left"
    assert out.getvalue() == f"\r{first}\r{second}{' ' * (len(first) - len(second))}\n"
    assert "\n" not in out.getvalue()[:-1]  # one terminal line, rewritten


def test_no_tokens_and_no_steps_yet() -> None:
    progress = Progress("bench", total=3, tty=False, clock=FakeClock())
    assert progress.line() == "bench: 0/3 prompts | 0s elapsed"
    assert progress.left_s() is None and progress.rate("tr") == 0.0
