"""A worker that cannot serve stops what it started and its process exits (issue 45, defect 1): the
engine thread used to outlive a failed start, holding the gRPC port while health answered nothing."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading

import pytest

from trserve.services.worker.config import WorkerConfig
from trserve.services.worker.server import create_server


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trserve-engine")]


def test_a_start_that_fails_stops_the_engine_thread(decoder) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    before = len(_engine_threads())
    config = WorkerConfig(port=0, metrics_port=None, http_port=taken.getsockname()[1], warmup=False)
    try:
        with pytest.raises(Exception, match="HTTP API"):
            asyncio.run(create_server(config, decoder))
    finally:
        taken.close()
    assert len(_engine_threads()) == before  # the engine thread ended: nothing keeps the process alive


@pytest.mark.parametrize("flags", [["--http-port", "PORT"], ["--metrics-port", "PORT"]])
def test_the_process_exits_non_zero_when_a_port_is_in_use(flags: list[str], tmp_path) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    args = [a.replace("PORT", str(s.getsockname()[1])) for a in flags]
    try:
        out = subprocess.run([sys.executable, "-m", "trserve.services.cli", "serve", "--port", "0",
                              *args], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    finally:
        s.close()
    assert out.returncode != 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("field, value", [("grace_s", float("nan")), ("grace_s", float("inf")),
                                          ("max_connection_age_s", float("inf")),
                                          ("max_connection_age_grace_s", float("nan"))])
def test_durations_that_are_not_finite_are_refused_before_anything_starts(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{field: value})
