"""What a local cluster runs: validated once (CLI or test) and passed to LocalCluster."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DRAFT_MODES = ("remote", "replica")


@dataclass(frozen=True)
class ClusterConfig:
    """A split deployment on loopback: Redis, one matrix service, `workers` workers."""

    run_dir: str  # logs, Redis data (AOF) and cluster.json (pids, addresses)
    workers: int = 2
    draft_mode: str = "remote"  # how workers draft through the matrix service
    threads: int | None = None  # torch CPU threads per worker; None = torch's default
    # the workers' model (builtin name or local directory); the matrix service serves only this one
    model: str = "smollm2-135m-instruct"
    # 0 = free ports; else workers listen on base_port..base_port+workers-1, the matrix service on
    # base_port+workers and a started Redis on base_port+workers+1
    base_port: int = 0
    redis_url: str | None = None  # None = start a private redis-server (AOF on) in run_dir
    key_prefix: str = "trserve"
    snapshot_every_versions: int = 64
    snapshot_every_s: float = 10.0
    worker_grace_s: float = 2.0  # in-flight requests may finish this long on `down`
    start_timeout_s: float = 240.0  # per process: model load and warm-up on a busy 2-core machine
    # security (all optional): files, as the servers take them
    tls_cert: str | None = None  # every server serves TLS with this certificate...
    tls_key: str | None = None  # ...and key
    tls_ca: str | None = None  # what clients and workers trust; default tls_cert (self-signed)
    tenant_tokens: str | None = None  # workers require per-tenant bearer tokens (JSON file)
    matrix_secret: str | None = None  # the matrix service requires it; workers send it
    matrix_admin_secret: str | None = None  # the matrix service's admin RPCs require it (matrix-admin sends it)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 16:
            raise ValueError(f"workers must be in 1..16 on one machine, got {self.workers}")
        if not self.model:
            raise ValueError("model must be a builtin name or a local model directory")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.base_port and not 1024 <= self.base_port <= 65535 - self.workers - 1:
            raise ValueError(f"base_port must be 0 (free ports) or in 1024..{65535 - self.workers - 1}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        for name in ("tls_cert", "tls_key", "tls_ca", "tenant_tokens", "matrix_secret", "matrix_admin_secret"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name} file {path!r} does not exist")

    @property
    def client_ca(self) -> str | None:
        """The CA file clients (health probes, workers, load) trust; None = plaintext."""
        return self.tls_ca or self.tls_cert

    def port(self, role: str, index: int = 0) -> int:
        """The port of a role ("worker", "matrix", "redis"); 0 = pick a free one."""
        if not self.base_port:
            return 0
        return self.base_port + {"worker": index, "matrix": self.workers, "redis": self.workers + 1}[role]
