"""LocalCluster: the split deployment as local processes on loopback, for tests, drills and users
without containers. Redis (private, AOF persistence in the run dir, unless a URL is given), one
`trserve matrix`, N `trserve worker`s. Every process can be killed (-9) and started again on the
same port, so tests can stage crashes; `cluster.json` in the run dir records pids and addresses
for `trserve cluster status|down` from another process."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from .config import ClusterConfig
from .procs import Proc, StartError, free_port, wait_serving

STATE_FILE = "cluster.json"
HOST = "127.0.0.1"


@dataclass
class WorkerProc:
    proc: Proc
    addr: str = ""  # HOST:PORT once started
    metrics_url: str = ""


class LocalCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.run_dir = Path(config.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.redis: Proc | None = None
        self.redis_port = 0
        self.matrix: Proc | None = None
        self.matrix_port = config.port("matrix")  # fixed by the first start: restarts come back there
        self.workers: list[WorkerProc] = []

    # -- addresses ---------------------------------------------------------------------------
    @property
    def redis_url(self) -> str:
        return self.config.redis_url or f"redis://{HOST}:{self.redis_port}/0"

    @property
    def matrix_addr(self) -> str:
        return f"{HOST}:{self.matrix_port}"

    @property
    def worker_addrs(self) -> list[str]:
        return [w.addr for w in self.workers]

    # -- whole cluster -----------------------------------------------------------------------
    def start(self) -> None:
        """Redis, the matrix service, then every worker (loading their models at once); returns
        when all report SERVING. On failure, stops what it started and raises StartError."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.config.redis_url is None:
                self.start_redis()
            self.start_matrix()
            self.workers = [WorkerProc(self._spawn_worker(i)) for i in range(self.config.workers)]
            for i in range(self.config.workers):
                self._await_worker(i)
        except BaseException:
            self.stop()
            raise
        self.save_state()

    def stop(self) -> None:
        """Gracefully: workers (drain), the matrix service (final snapshots), then Redis (AOF flush)."""
        for w in self.workers:
            w.proc.terminate()
        for proc in (self.matrix, self.redis):
            if proc is not None:
                proc.terminate()
        (self.run_dir / STATE_FILE).unlink(missing_ok=True)

    def save_state(self) -> None:
        """cluster.json: what `trserve cluster status|down` need."""
        state = {
            "redis": {"url": self.redis_url, "pid": self.redis.pid if self.redis else None},
            "matrix": {"addr": self.matrix_addr, "pid": self.matrix.pid if self.matrix else None},
            "workers": [{"addr": w.addr, "metrics_url": w.metrics_url, "pid": w.proc.pid} for w in self.workers],
            "tls_ca": self.config.client_ca,
            "log_dir": str(self.log_dir),
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=2))

    # -- Redis -------------------------------------------------------------------------------
    def start_redis(self) -> None:
        """A private redis-server with append-only-file persistence in run_dir/redis (same port on restarts)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise StartError("redis-server is not installed (apt-get install redis-server); or give a Redis URL")
        self.redis_port = self.redis_port or self.config.port("redis") or free_port()
        data = self.run_dir / "redis"
        data.mkdir(parents=True, exist_ok=True)
        self.redis = Proc("redis", [binary, "--bind", HOST, "--port", str(self.redis_port), "--dir", str(data),
                                    "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                          self.log_dir / "redis.log")
        client = redis.Redis(host=HOST, port=self.redis_port, socket_timeout=1, socket_connect_timeout=1)
        try:
            end = time.monotonic() + 30
            while self.redis.alive and time.monotonic() < end:
                try:
                    if client.ping():
                        self.save_state()  # a restart changes the pid
                        return
                except redis.RedisError:
                    time.sleep(0.1)
        finally:
            client.close()
        raise StartError(f"redis-server did not answer on port {self.redis_port}; its log:\n{self.redis.log_tail()}")

    # -- the matrix service ------------------------------------------------------------------
    def start_matrix(self) -> None:
        c = self.config
        args = ["matrix", "--host", HOST, "--port", str(self.matrix_port), "--redis-url", self.redis_url,
                "--key-prefix", c.key_prefix, "--snapshot-every-versions", str(c.snapshot_every_versions),
                "--snapshot-every-s", str(c.snapshot_every_s), "--model", c.model]
        args += self._tls_args() + (["--secret-file", c.matrix_secret] if c.matrix_secret else [])
        args += ["--admin-secret-file", c.matrix_admin_secret] if c.matrix_admin_secret else []
        self.matrix = Proc.trserve("matrix", args, self.log_dir)
        addr = self.matrix.wait_line("matrix service listening on", c.start_timeout_s)
        self.matrix_port = int(addr.rsplit(":", 1)[1])
        wait_serving(self.matrix_addr, c.client_ca, c.start_timeout_s, self.matrix)
        self.save_state()  # a restart changes the pid

    def kill_matrix(self) -> None:
        if self.matrix is not None:
            self.matrix.kill()

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()

    # -- workers -----------------------------------------------------------------------------
    def _spawn_worker(self, i: int) -> Proc:
        c = self.config
        args = ["worker", "--matrix-addr", self.matrix_addr, "--draft-mode", c.draft_mode, "--host", HOST,
                "--port", str(c.port("worker", i)), "--metrics-port", "0", "--grace", str(c.worker_grace_s),
                "--http-port", "0", "--model", c.model]  # no HTTP API: N local workers would all want port 8000
        args += ["--threads", str(c.threads)] if c.threads else []
        args += self._tls_args() + (["--matrix-tls-ca", c.client_ca] if c.client_ca else [])
        args += ["--tenant-tokens", c.tenant_tokens] if c.tenant_tokens else []
        args += ["--matrix-secret-file", c.matrix_secret] if c.matrix_secret else []
        return Proc.trserve(f"worker-{i}", args, self.log_dir)

    def _await_worker(self, i: int) -> None:
        w, timeout = self.workers[i], self.config.start_timeout_s
        w.addr = w.proc.wait_line("trserve listening on", timeout)
        w.metrics_url = w.proc.wait_line("trserve metrics on", 10)
        wait_serving(w.addr, self.config.client_ca, timeout, w.proc)

    def kill_worker(self, i: int) -> None:
        self.workers[i].proc.kill()

    def _tls_args(self) -> list[str]:
        c = self.config
        return ["--tls-cert", c.tls_cert, "--tls-key", c.tls_key] if c.tls_cert else []
