"""Child processes of a local cluster: spawn detached with a log file, read what they print,
probe their gRPC health, stop them by pid (also from another process, after `cluster up` exited)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..common.security import client_channel


class StartError(RuntimeError):
    """A process did not come up; the message ends with the tail of its log."""


def free_port() -> int:
    """A TCP port free on loopback right now (for programs that cannot bind port 0 and report it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own session (it outlives its parent), stdout and stderr appended to `log_path`."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._offset = log_path.stat().st_size if log_path.exists() else 0  # this run's lines start here
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    @classmethod
    def trserve(cls, name: str, args: list[str], log_dir: Path) -> Proc:
        """`trserve ARGS` with this interpreter (the same venv as the caller)."""
        return cls(name, [sys.executable, "-m", "trserve.services.cli", *args], log_dir / f"{name}.log")

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_line(self, prefix: str, timeout: float = 120.0) -> str:
        """The last word of this run's first log line starting with `prefix` (an address or URL)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.log_path.open("rb") as log:
                log.seek(self._offset)
                for line in log.read().decode(errors="replace").splitlines():
                    if line.startswith(prefix):
                        return line.split()[-1]
            if not self.alive:
                raise StartError(f"{self.name} exited with code {self.popen.returncode}; its log:\n{self.log_tail()}")
            time.sleep(0.1)
        raise StartError(f"{self.name} did not print {prefix!r} within {timeout:.0f} s; its log:\n{self.log_tail()}")

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.alive:
            self.popen.kill()
        self.popen.wait(timeout=30)

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (graceful: drain, final snapshots), then SIGKILL after `timeout`."""
        if self.alive:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def health_status(addr: str, tls_ca_file: str | None = None, timeout: float = 2.0) -> str:
    """SERVING, NOT_SERVING, ... or UNREACHABLE: the gRPC health of the whole server."""
    with client_channel(addr, tls_ca_file) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(addr: str, tls_ca_file: str | None = None, timeout: float = 120.0, proc: Proc | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if health_status(addr, tls_ca_file) == "SERVING":
            return
        if proc is not None and not proc.alive:
            raise StartError(f"{proc.name} exited with code {proc.popen.returncode}; its log:\n{proc.log_tail()}")
        time.sleep(0.1)
    raise StartError(f"{addr} did not report SERVING within {timeout:.0f} s")


# -- by pid, for `trserve cluster down|status` -------------------------------------------------------------
def pid_runs(pid: int, marker: str) -> bool:
    """Whether `pid` is alive and its command line contains `marker` (a recycled pid is not ours)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return status != "Z" and marker in cmdline


def stop_pid(pid: int, marker: str, timeout: float = 30.0) -> bool:
    """SIGTERM `pid` if it is still ours, SIGKILL after `timeout`; whether it was running."""
    if not pid_runs(pid, marker):
        return False
    for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        os.kill(pid, sig)
        end = time.monotonic() + wait_s
        while pid_runs(pid, marker) and time.monotonic() < end:
            time.sleep(0.1)
        if not pid_runs(pid, marker):
            break
    return True
