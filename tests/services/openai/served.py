"""`trserve serve` as a process of its own, on loopback ports, for the OpenAI API's tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(tmp: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """`trserve serve` (the bundled model unless `args` say) with gRPC on a port of its choosing and the
    OpenAI API on a free one: (gRPC address, OpenAI base URL). Its log is tmp/serve.log; SIGTERM at the end."""
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "trserve.services.cli", "serve", "--port", "0", "--metrics-port",
                             "-1", "--http-port", str(free_port()), *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=log, text=True, env={**os.environ, **(env or {})})
    try:
        grpc_line, http_line = proc.stdout.readline(), proc.stdout.readline()
        assert grpc_line.startswith("trserve listening on 127.0.0.1:"), (grpc_line, (tmp / "serve.log").read_text())
        assert http_line.startswith("trserve OpenAI API on http://127.0.0.1:"), http_line
        yield grpc_line.split()[-1], http_line.split()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
