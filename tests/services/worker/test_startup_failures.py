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
from trserve.services.openai.server import front_end
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
            asyncio.run(create_server(config, decoder, front_end=front_end))
        with pytest.raises(ValueError, match="no front end"):  # a port to serve and nothing to serve it with
            asyncio.run(create_server(config, decoder))
    finally:
        taken.close()
    assert len(_engine_threads()) == before  # the engine thread ended: nothing keeps the process alive


@pytest.mark.parametrize("flags, env, says", [
    (["--http-port", "TAKEN"], {}, "(--http-port: Address already in use)"),
    (["--metrics-port", "TAKEN"], {}, "(--metrics-port: Address already in use)"),
    (["--port", "FREE", "--http-port", "FREE"], {}, "--http-port FREE is also --port"),
    (["--redis-url", "not-a-url"], {}, "argument --redis-url: 'not-a-url' is not a Redis URL"),
    ([], {"TRSERVE_GRACE": "nan"}, "TRSERVE_GRACE='nan' is not a valid value for --grace"),
    ([], {"TRSERVE_MAX_CONNECTION_AGE_S": "inf"}, "TRSERVE_MAX_CONNECTION_AGE_S='inf' is not a valid value"),
    # issue 56, defect 7: an unusable --model path, named with what it lacks
    (["--model", "EMPTY"], {}, "is not a transformers checkpoint: it lacks config.json, a tokenizer"),
    (["--model", "CONFIG_ONLY"], {}, "it lacks a tokenizer (tokenizer.json, tokenizer.model or vocab.json), weights"),
    (["--model", "./no/such/dir"], {}, "--model './no/such/dir' does not exist"),
    (["--model", "FILE"], {}, "is a file but not a .gguf one"),
])
def test_the_process_exits_at_once_naming_the_cause(flags: list[str], env: dict, says: str, tmp_path) -> None:
    """Issue 45, defect 1: the six configurations the probe round found each leave a process that never
    exits. Each must exit non-zero within 10 s (ports are tried before the model loads), with one line
    naming the cause and no traceback."""
    import os
    import time

    taken, free = socket.socket(), socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    free.bind(("127.0.0.1", 0))
    free_port = str(free.getsockname()[1])
    free.close()
    for name in ("EMPTY", "CONFIG_ONLY"):
        (tmp_path / name).mkdir()
    (tmp_path / "CONFIG_ONLY" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "FILE").write_text("not a model")
    args = [a.replace("TAKEN", str(taken.getsockname()[1])).replace("FREE", free_port) for a in flags]
    says = says.replace("FREE", free_port)
    if "--port" not in args:
        args += ["--port", "0"]
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "trserve.services.cli", "serve", *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=180, env={**os.environ, **env})
    finally:
        taken.close()
    took = time.monotonic() - started
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and took < 10, (took, out.stderr[-2000:])


@pytest.mark.parametrize("field, value", [("grace_s", float("nan")), ("grace_s", float("inf")),
                                          ("max_connection_age_s", float("inf")),
                                          ("max_connection_age_grace_s", float("nan"))])
def test_durations_that_are_not_finite_are_refused_before_anything_starts(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerConfig(**{field: value})


def test_a_worker_whose_warm_up_fails_exits(tmp_path) -> None:
    """A worker whose warm-up generation failed (a kernel library refusing its input) sat there forever,
    never SERVING and never exiting, its gRPC port held. It now closes what it started and exits 1,
    with one line naming the failure after the logged traceback."""
    import os
    from pathlib import Path

    helper = Path(__file__).resolve().parent / "broken_forward"
    out = subprocess.run([sys.executable, "-m", "trserve.services.cli", "serve", "--port", "0", "--metrics-port", "-1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(helper), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 1, out.stderr[-2000:]
    assert "trserve serve: the warm-up generation failed (RuntimeError: native forward refused its input" in out.stderr
    assert "trserve listening" not in out.stdout
