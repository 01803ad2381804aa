"""A matrix service that cannot serve exits at once with one line naming the cause (issue 45, defect 1,
for `trserve matrix`): its gRPC or metrics port in use, a Redis URL that is not one, a drain time
that is not a number of seconds, a public host without the workers' secret."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("flags, says", [
    (["--port", "TAKEN"], "cannot listen on 127.0.0.1:"),
    (["--port", "0", "--metrics-port", "TAKEN"], "cannot serve metrics on 127.0.0.1:"),
    (["--port", "0", "--redis-url", "not-a-url"], "argument --redis-url: 'not-a-url' is not a Redis URL"),
    (["--port", "0", "--grace-s", "nan"], "argument --grace-s: nan is out of range"),
    (["--port", "0", "--host", "0.0.0.0", "--model", "fp:64:8"], "without the workers' secret"),
])
def test_the_process_exits_with_one_line(flags: list[str], says: str, tmp_path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    argv = [a.replace("TAKEN", str(taken.getsockname()[1])) for a in flags]
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "trserve.services.cli", "matrix", *argv], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert out.returncode in (1, 2) and says in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and time.monotonic() - started < 10, out.stderr[-2000:]
