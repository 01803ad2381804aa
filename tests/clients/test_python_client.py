"""The light client (issue 30 item 2): clients/python installs into a fresh venv with grpcio and
protobuf only (no torch), and calls a running worker: the same ids as the server-side client, a
stream whose chunks add up to the unary answer, the token and plaintext rule, and a status code."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trserve.services.client.client import TRServeClient
from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import serving

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def worker(decoder):
    yield from serving(WorkerConfig(port=0, metrics_port=None, limits=Limits(max_new_tokens_cap=64, default_max_new_tokens=16)), decoder)


@pytest.fixture(scope="module", params=["3.11", "3.12"])
def client_venv(request, tmp_path_factory) -> Path:
    """A fresh venv with the client installed, on Python 3.11 and 3.12: the interpreter the tests run
    on, and the other where this machine has one."""
    venv = tmp_path_factory.mktemp(f"client-venv-{request.param}")
    if request.param == "%d.%d" % sys.version_info[:2]:
        base = getattr(sys, "_base_executable", sys.executable)  # not the project's venv: a fresh one
    else:
        found = [shutil.which(f"python{request.param}")] + sorted(
            glob.glob(os.path.expanduser(f"~/.pyenv/versions/{request.param}*/bin/python{request.param}")))
        base = next((p for p in found if p and not subprocess.run([p, "--version"], capture_output=True,
                                                                  timeout=60).returncode), None)
        if base is None:  # (a pyenv shim of a version that is not selected fails to run)
            pytest.skip(f"no python{request.param} on this machine")
    version = subprocess.run([base, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    assert version == request.param
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(REPO / "clients" / "python")],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


@pytest.mark.timeout(900)
def test_the_light_client_installs_without_torch_and_calls_a_worker(client_venv, worker) -> None:
    python = str(client_venv / "bin" / "python")
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True,
                            timeout=120)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "trserve-client" in names and {"grpcio", "protobuf"} <= names
    assert not names & {"torch", "numpy", "transformers", "trserve"}, names
    assert subprocess.run([python, "-m", "pip", "show", "torch"], capture_output=True, timeout=120).returncode != 0

    script = textwrap.dedent(f"""
        import json, sys
        import grpc
        from trserve_client import Client, service_config
        out = {{"config": service_config()}}
        with Client({worker.addr!r}, timeout=120) as c:
            r = c.generate(messages={HI!r}, max_new_tokens=16, mode="ar", return_token_ids=True)
            out["ids"], out["text"] = list(r.token_ids), r.text
            chunks = list(c.stream(messages={HI!r}, max_new_tokens=16))
            out["stream_ids"] = [i for ch in chunks for i in ch.token_ids]
            out["stream_text"] = "".join(ch.text for ch in chunks)
            out["finish"] = chunks[-1].finish_reason
            out["vocab"] = c.model_info().vocab_size
            try:
                c.generate("", max_new_tokens=4)
            except grpc.RpcError as e:
                out["empty"] = e.code().name
        try:
            Client("10.1.2.3:50051", token="t")
        except ValueError as e:
            out["plaintext"] = str(e)
        out["torch_loaded"] = "torch" in sys.modules
        print(json.dumps(out))
    """)
    run = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300, cwd=client_venv)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    with TRServeClient(worker.addr, timeout=120) as ours:
        reference = ours.generate(messages=HI, max_new_tokens=16, mode="ar", return_token_ids=True)
        vocab = ours.model_info().vocab_size
    assert out["ids"] == list(reference.token_ids) == out["stream_ids"] and out["text"] == reference.text
    assert out["stream_text"] == out["text"] and out["finish"] == reference.finish_reason
    assert out["empty"] == "INVALID_ARGUMENT" and "refusing to send a tenant token" in out["plaintext"]
    assert out["vocab"] == vocab
    assert json.loads(out["config"]) == json.loads((REPO / "services" / "client" / "service_config.json").read_text())
    assert out["torch_loaded"] is False

