"""The concurrency bench's summary: the prefill share and decode-only tokens/s of a level."""

import pytest

from bench.concurrency import _summary, format_table


def test_summary_splits_prefill_from_decode():
    done = [{"tokens": 64, "latency": 1.0, "ttft": 0.2, "mat": 1.5}, {"tokens": 36, "latency": 2.0, "ttft": 0.4, "mat": 1.0}]
    row = _summary("tr", 2, done, wall=4.0, prefill_s=1.5)
    assert row["tokens_per_s"] == 25.0  # 100 tokens / 4 s
    assert row["prefill_share"] == pytest.approx(0.375)
    assert row["decode_tokens_per_s"] == 40.0  # 100 tokens / (4 - 1.5) s
    assert row["mat"] == 1.25
    line = format_table([row]).splitlines()[1]
    assert "38%" in line and line.endswith("40.0")
